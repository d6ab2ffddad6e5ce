"""GPU tier for the prefill GEMM kernel (triton.moe_sm90_prefill: decode warps, wgmma from shared memory).

Tolerance (REL_TOL), ||out - ref|| / ||ref|| against the float64 reference on the same NVFP4 weights: the weights
decode exactly, so what remains is the rounding of x, of the activation rows and of the output to the activation
dtype (bf16: 8 significant bits, fp16: 11), as for the other kernels (test_fused_moe_gpu.py).
"""
from __future__ import annotations

import dataclasses
import secrets

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.configs import GemmConfig, MoEKernelConfig
from moe_nvfp4.triton.moe_sm90 import fused_moe_sm90

pytestmark = pytest.mark.gpu

REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
PREFILL = GemmConfig(block_n=128, num_stages=4, num_warps=4, decode_warps=True)


@dataclasses.dataclass(frozen=True)
class Case:
    why: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    block_m: int = 128
    routing: str = "random"  # random | one_expert | half_empty


CASES = [
    Case("Mixtral-like, several token tiles an expert", 8, 2, 1024, 1024, 1000),
    Case("Qwen3-like, many experts, 64-token tiles", 128, 8, 512, 256, 300, 64),
    Case("K not a multiple of 128 on both GEMMs (padded tails)", 6, 2, 144, 208, 77),
    Case("N not a multiple of 128 (GEMM2's last tile half empty)", 8, 2, 320, 192, 130),
    Case("every token to one expert", 8, 2, 256, 256, 400, 128, "one_expert"),
    Case("half the experts empty, odd T", 16, 4, 256, 128, 333, 64, "half_empty"),
    Case("one token", 8, 2, 256, 256, 1),
]


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _problem(case: Case, gen: torch.Generator, dtype: torch.dtype):
    w13 = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen, device="cuda") / case.hidden**0.5
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=gen, device="cuda") / case.inter**0.5
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6], device="cuda") / 6
    w13[..., :16] = grid * w13.abs().amax(-1, keepdim=True)  # the full FP4 code range in every row
    q13, q2 = m.quantize_nvfp4(w13, segments=2), m.quantize_nvfp4(w2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(case.tokens, case.experts, generator=gen, device="cuda")
    if case.routing == "half_empty":
        logits[:, case.experts // 2 :] = -1e9
    tw, ti = m.topk_softmax(logits, case.top_k, renormalize=True)
    if case.routing == "one_expert":
        ti = (3 + torch.arange(case.top_k, device="cuda", dtype=torch.int32)).expand(case.tokens, -1) % case.experts
        ti = ti.contiguous()
    return q13, q2, x, tw, ti


def _prefill_config(block_m: int, gemm1: bool = True, gemm2: bool = True) -> MoEKernelConfig:
    triton_gemm = GemmConfig(block_n=128, num_warps=8, num_stages=3)
    return MoEKernelConfig(block_m, PREFILL if gemm1 else triton_gemm, PREFILL if gemm2 else triton_gemm,
                           partials_in_x_dtype=True)


def _poisoned(x: torch.Tensor, args: tuple, cfg: MoEKernelConfig) -> torch.Tensor:
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # the scratch the forward reuses is NaN too
    out = torch.full_like(x, float("nan"))
    fused_moe_sm90(x, *args, cfg, out=out)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_prefill_kernel_matches_reference(case: Case, dtype: torch.dtype, gen: torch.Generator) -> None:
    q13, q2, x, tw, ti = _problem(case, gen, dtype)
    weights = m.prepare_moe_weights(q13, q2)
    cfg = _prefill_config(case.block_m)
    assert cfg.is_valid(*weights.layer_shape(case.top_k, dtype).padded_k)
    out = _poisoned(x, (*weights.tensors, tw, ti, None, case.inter), cfg)
    assert not out.isnan().any(), "unwritten output"
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("which", ["gemm1", "gemm2"])
def test_each_gemm_alone_matches_the_triton_kernel(which: str, gen: torch.Generator) -> None:
    """One GEMM on the prefill kernel, the other on the Triton kernel: the same sums (whole K per tile, exact
    products), so the outputs agree to the roundings of accumulation order."""
    case = CASES[0]
    q13, q2, x, tw, ti = _problem(case, gen, torch.bfloat16)
    weights = m.prepare_moe_weights(q13, q2)
    args = (*weights.tensors, tw, ti, None, case.inter)
    ours = fused_moe_sm90(x, *args, _prefill_config(128, which == "gemm1", which == "gemm2"))
    theirs = fused_moe_sm90(x, *args, _prefill_config(128, False, False))
    assert _rel(ours, theirs) < 2e-3


def test_expert_map_and_relu2(gen: torch.Generator) -> None:
    """Expert parallelism (other ranks' pairs contribute nothing) and ReLU² without up rows (GEMM1 then tiles one
    matrix by 128 rows) on the prefill kernel."""
    case = Case("ep", 4, 2, 256, 256, 300)
    q13, q2, x, tw, _ = _problem(case, gen, torch.bfloat16)
    expert_map = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    expert_map[torch.tensor([1, 4, 6, 7])] = torch.arange(4, dtype=torch.int32, device="cuda")
    tw, ti = m.topk_softmax(torch.randn(case.tokens, 8, generator=gen, device="cuda"), 2)
    weights = m.prepare_moe_weights(q13, q2)
    out = _poisoned(x, (*weights.tensors, tw, ti, expert_map, case.inter), _prefill_config(128))
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=expert_map, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[torch.bfloat16]

    tw, ti = m.topk_softmax(torch.randn(case.tokens, 4, generator=gen, device="cuda"), 2)
    w1 = m.quantize_nvfp4(torch.randn(4, case.inter, case.hidden, generator=gen, device="cuda") / case.hidden**0.5)
    relu2 = m.prepare_moe_weights(w1, q2, activation=m.RELU2)
    out = fused_moe_sm90(x, *relu2.tensors, tw, ti, None, case.inter, _prefill_config(128), activation=m.RELU2)
    ref = m.fused_moe_torch(x, w1, q2, tw, ti, activation=m.RELU2, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[torch.bfloat16]


def test_cuda_graph_replay(gen: torch.Generator) -> None:
    """Captured once, replayed on new routing: the grid never depends on routing data."""
    case = CASES[1]
    q13, q2, x, tw, ti = _problem(case, gen, torch.bfloat16)
    weights = m.prepare_moe_weights(q13, q2)
    cfg = _prefill_config(case.block_m)
    args = (*weights.tensors, tw, ti, None, case.inter)
    out = fused_moe_sm90(x, *args, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_sm90(x, *args, cfg)
    new_tw, new_ti = m.topk_softmax(torch.randn(case.tokens, case.experts, generator=gen, device="cuda"), case.top_k)
    tw.copy_(new_tw)
    ti.copy_(new_ti)
    graph.replay()
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[torch.bfloat16]
