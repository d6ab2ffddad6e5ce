"""W4A4 grouped GEMM on the GPU: bit for bit on exact data (fp16 and bf16 out; also a planned launch replayed
in a CUDA graph after new inputs are written), at the four shapes of the
public B200 NVFP4 group-GEMM problem; ||out - ref|| / ||ref|| < 2e-3 (fp16) / 8e-3 (bf16) on random data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_w4a4 import exact_groups, random_groups  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (M per group, N, K) of the benchmark's four problems
PROBLEMS = [
    ([80, 176, 128, 72, 64, 248, 96, 160], 4096, 7168),
    ([40, 76, 168, 72, 164, 148, 196, 160], 7168, 2048),
    ([192, 320], 3072, 4096),
    ([128, 384], 4096, 1536),
]
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
# plan_grouped_w4a4 tile configs besides the default 128x128x64 (w8, 3 stages): the ones timed against it
TILE_CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=3),
]
# ragged M (one empty group), N not a multiple of any tile, K with a masked tail (48, 272)
RAGGED = [(37, 48, 48), (0, 64, 128), (130, 80, 272), (5, 130, 64)]


def _cuda(groups: list[m.NVFP4Tensor]) -> list[m.NVFP4Tensor]:
    return [t.to("cuda") for t in groups]


@pytest.mark.parametrize("problem", range(len(PROBLEMS)))
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_bit_exact_on_exact_data(problem: int, out_dtype: torch.dtype, seed: int) -> None:
    ms, n, k = PROBLEMS[problem]
    a, b, alpha = exact_groups([(mm, n, k) for mm in ms], seed)
    got = m.grouped_gemm_nvfp4(_cuda(a), _cuda(b), alpha=alpha.cuda(), out_dtype=out_dtype)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=out_dtype)
    for g, (x, y) in enumerate(zip(got, ref)):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x.cpu(), y), f"group {g}: {(x.cpu().float() - y.float()).abs().max()}"


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_random_data_within_bound(out_dtype: torch.dtype, seed: int) -> None:
    sizes = [(0, 256, 512), (1, 384, 512), (77, 200, 1024), (300, 64, 160)]
    a, b = random_groups(sizes, seed)
    got = m.grouped_gemm_nvfp4(_cuda(a), _cuda(b), out_dtype=out_dtype)
    ref = m.grouped_gemm_nvfp4_torch(a, b, out_dtype=out_dtype)
    assert got[0].shape == (0, 256)
    for x, y in zip(got[1:], ref[1:]):
        assert ((x.cpu().float() - y.float()).norm() / y.float().norm()).item() < REL_TOL[out_dtype]


def test_planned_launch_replays_in_a_cuda_graph(seed: int) -> None:
    sizes = [(64, 256, 512), (3, 256, 512), (130, 256, 512)]
    a, b, alpha = exact_groups(sizes, seed)
    plan = m.plan_grouped_gemm_nvfp4(_cuda(a), _cuda(b), alpha=alpha.cuda(), out_dtype=torch.bfloat16)
    m.launch_grouped_gemm_nvfp4(plan)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.launch_grouped_gemm_nvfp4(plan)
    a2, _, _ = exact_groups(sizes, seed + 1)
    for packed, scales, new in zip(plan.inputs[0], plan.inputs[1], a2):
        packed.copy_(new.packed)
        scales.copy_(new.swizzled_scales().block_scale)
    for out in plan.outs:
        out.fill_(float("nan"))
    graph.replay()
    ref = m.grouped_gemm_nvfp4_torch(a2, b, alpha=alpha, out_dtype=torch.bfloat16)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(plan.outs, ref))


@pytest.mark.parametrize(
    "config", TILE_CONFIGS, ids=lambda c: "bm{block_m}_bn{block_n}_bk{block_k}_w{num_warps}".format(**c)
)
@pytest.mark.parametrize("sizes", [2, 3, "ragged"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_tile_configs_bit_exact(config: dict, sizes: int | str, out_dtype: torch.dtype, seed: int) -> None:
    """sizes: a problem's index (its smaller two) or the ragged groups."""
    from moe_nvfp4.triton.grouped_w4a4 import plan_grouped_w4a4

    if sizes == "ragged":
        groups = RAGGED
    else:
        ms, n, k = PROBLEMS[sizes]
        groups = [(mm, n, k) for mm in ms]
    a, b, alpha = exact_groups(groups, seed)
    default = m.plan_grouped_gemm_nvfp4(_cuda(a), _cuda(b), alpha=alpha.cuda(), out_dtype=out_dtype)
    plan = plan_grouped_w4a4(*default.inputs, default.alpha, out_dtype, **config)
    got = m.launch_grouped_gemm_nvfp4(plan)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=out_dtype)
    for g, (x, y) in enumerate(zip(got, ref)):
        assert torch.equal(x.cpu(), y), f"group {g}: {(x.cpu().float() - y.float()).abs().max()}"
