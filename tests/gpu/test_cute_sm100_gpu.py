"""The sm_100a CuTe DSL W4A4 grouped GEMM on a Blackwell GPU (skipped elsewhere): bit for bit against
``reference.grouped_gemm_nvfp4_torch`` on exact data at the public B200 benchmark's four shapes, both tile
widths and both output dtypes, plus ragged groups (M = 0, M = 1, M not a multiple of 128, K = 32)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_w4a4 import exact_groups  # noqa: E402


def _is_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm100(), reason="needs an sm_100 (Blackwell) GPU")]

PROBLEMS = [  # (M per group, N, K) of the benchmark's four problems
    ([80, 176, 128, 72, 64, 248, 96, 160], 4096, 7168),
    ([40, 76, 168, 72, 164, 148, 196, 160], 7168, 2048),
    ([192, 320], 3072, 4096),
    ([128, 384], 4096, 1536),
]
RAGGED = [(0, 256, 512), (1, 384, 512), (77, 200, 1024), (300, 64, 160), (130, 136, 32)]


def _run(sizes: list[tuple[int, int, int]], seed: int, out_dtype: torch.dtype, tile_n: int) -> None:
    from moe_nvfp4.cute.host import launch_grouped_w4a4_sm100, plan_grouped_w4a4_sm100

    a, b, alpha = exact_groups(sizes, seed)
    # The public planner swizzles the scales and folds both global scales into alpha; its plan's inputs are
    # exactly the sm_100 planner's arguments.
    checked = m.plan_grouped_gemm_nvfp4(
        [t.to("cuda") for t in a], [t.to("cuda") for t in b], alpha=alpha.cuda(), out_dtype=out_dtype
    )
    plan = plan_grouped_w4a4_sm100(checked.inputs, checked.alpha, out_dtype, tile_n=tile_n)
    got = launch_grouped_w4a4_sm100(plan)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=out_dtype)
    for g, (x, y) in enumerate(zip(got, ref)):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x.cpu(), y), f"group {g}: max |diff| {(x.cpu().float() - y.float()).abs().max()}"


@pytest.mark.parametrize("problem", range(len(PROBLEMS)))
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile_n", [128, 256])
def test_bit_exact_on_benchmark_shapes(problem: int, out_dtype: torch.dtype, tile_n: int, seed: int) -> None:
    ms, n, k = PROBLEMS[problem]
    _run([(mm, n, k) for mm in ms], seed, out_dtype, tile_n)


@pytest.mark.parametrize("tile_n", [128, 256])
def test_bit_exact_on_ragged_groups(tile_n: int, seed: int) -> None:
    _run(RAGGED, seed, torch.float16, tile_n)
