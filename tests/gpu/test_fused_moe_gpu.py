"""GPU tier for the sm_90 Triton fused MoE (run with ``pytest -m gpu`` on the GPU machine).

Tolerances (REL_TOL), ||out - ref|| / ||ref|| against the float64 reference on the same NVFP4 weights: the
weights decode exactly, so what remains is the rounding of x, of the SiLU*up intermediate and of the output
to the activation dtype (bf16: 8 significant bits, fp16: 11).  The expert-MLP variants (activations, biases, the
router weight on the input) have the same roundings and the same bound.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import moe_nvfp4 as m
from moe_nvfp4.shapes import device_traits
from moe_nvfp4.sm90.common import _silu_times, _swiglu_oai
from moe_nvfp4.sm90.configs import KERNEL_NAME, GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90.host import compiled_variants, fused_moe_sm90
from moe_nvfp4.sm90.tuned_configs import CONFIG_DIR, load_config_file, select_config, tuned_file_for
from moe_nvfp4.triton.routing_kernels import route

pytestmark = pytest.mark.gpu

REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class Case:
    why: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    routing: str = "random"  # random | one_expert | half_empty


CASES = [
    Case("decode, one token", 8, 2, 256, 512, 1),
    Case("odd T, E not a power of two, top-3", 5, 3, 384, 256, 7),
    Case("no tokens", 8, 2, 256, 256, 0),
    Case("every token to one expert", 8, 2, 256, 256, 40, "one_expert"),
    Case("half the experts empty", 16, 4, 256, 128, 33, "half_empty"),
    Case("K not a multiple of 128 (padded tail)", 6, 2, 144, 80, 9),
    Case("many experts, top-8 (Qwen3-like)", 128, 8, 256, 128, 65),
    Case("top-16", 64, 16, 128, 128, 5),
    Case("prefill-sized tiles", 8, 2, 1024, 1024, 600),
]


def _routing(case: Case, gen: torch.Generator, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(case.tokens, case.experts, generator=gen, device=dev)
    if case.routing == "one_expert":  # slot j of every token goes to expert 3 + j
        ids = (3 + torch.arange(case.top_k, device=dev, dtype=torch.int32)).expand(case.tokens, -1) % case.experts
        w = torch.softmax(torch.randn(case.tokens, case.top_k, generator=gen, device=dev), -1)
        return w, ids.contiguous()
    if case.routing == "half_empty":
        logits[:, case.experts // 2 :] = -1e9
    return m.topk_softmax(logits, case.top_k, renormalize=True)


def _layer(case: Case, gen: torch.Generator, dev: str):
    w13 = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen, device=dev) / case.hidden**0.5
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=gen, device=dev) / case.inter**0.5
    # Plant the full FP4 code range (incl. +-2, 3, 4, 6) in the first block of every row.
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6], device=dev) / 6
    w13[..., :16] = grid * w13.abs().amax(-1, keepdim=True)
    return m.quantize_nvfp4(w13, segments=2), m.quantize_nvfp4(w2)


def _problem(case: Case, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """(q13, q2, packed weights, x, topk_weights, topk_ids) for a random layer and softmax routing."""
    q13, q2 = _layer(case, gen, "cuda")
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = m.topk_softmax(torch.randn(case.tokens, case.experts, generator=gen, device="cuda"), case.top_k)
    return q13, q2, m.prepare_moe_weights(q13, q2), x, tw, ti


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _poisoned_run(x: torch.Tensor, args: tuple, cfg: MoEKernelConfig) -> torch.Tensor:
    """fused_moe_sm90(x, *args, cfg) into a NaN output, with the freed blocks its scratch will reuse NaN too;
    fails if any output element is left unwritten."""
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    fused_moe_sm90(x, *args, cfg, out=out)
    assert not out.isnan().any(), f"{cfg}: unwritten output"
    return out


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_matches_reference(case: Case, dtype: torch.dtype, gen: torch.Generator) -> None:
    q13, q2 = _layer(case, gen, "cuda")
    weights = m.prepare_moe_weights(q13, q2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = _routing(case, gen, "cuda")
    out = m.fused_moe(x, weights, tw, ti)
    assert out.shape == x.shape and out.dtype == dtype
    if case.tokens == 0:
        return
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_expert_map(dtype: torch.dtype, gen: torch.Generator) -> None:
    """Expert parallelism: this rank holds global experts 1, 4, 6; other pairs contribute nothing."""
    case = Case("ep", 3, 2, 256, 256, 31)
    q13, q2 = _layer(case, gen, "cuda")
    weights = m.prepare_moe_weights(q13, q2)
    expert_map = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    expert_map[torch.tensor([1, 4, 6])] = torch.arange(3, dtype=torch.int32, device="cuda")
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = m.topk_softmax(torch.randn(case.tokens, 8, generator=gen, device="cuda"), 2)
    out = m.fused_moe(x, weights, tw, ti, expert_map=expert_map)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=expert_map, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[dtype]


EP_DECODE = [  # (why, local experts, global experts, top-k, hidden, inter)
    ("half a pair expected at one token: K groups on both GEMMs", 8, 64, 4, 1024, 512),
    ("2-4 pairs expected: 64-row tiles, K groups on GEMM2", 8, 16, 4, 2048, 4096),
]


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("ep", EP_DECODE, ids=[e[0] for e in EP_DECODE])
def test_expert_parallel_decode_defaults_match_reference(ep: tuple, tokens: int, gen: torch.Generator) -> None:
    """The default at one or two tokens under expert parallelism (presets sized by the rank's expected pairs, design
    004 decision 9) on routings that leave the rank none of the pairs, one, and all: within REL_TOL of the reference,
    every output row written (exact zeros where no pair is local)."""
    why, local, total, k, h, i = ep
    case = Case(why, local, k, h, i, tokens)
    q13, q2 = _layer(case, gen, "cuda")
    weights = m.prepare_moe_weights(q13, q2)
    order = torch.randperm(total, generator=gen, device="cuda").to(torch.int32)
    owned, others = order[:local], order[local:]
    expert_map = torch.full((total,), -1, dtype=torch.int32, device="cuda")
    expert_map[owned.long()] = torch.arange(local, dtype=torch.int32, device="cuda")
    cfg = select_config(tokens, weights.layer_shape(k, torch.bfloat16, expert_map), device_traits(torch.device("cuda")))
    assert not cfg.pair_tiles and cfg.block_m == 8 and cfg.gemm2.k_groups == 2, cfg
    x = torch.randn(tokens, h, generator=gen, device="cuda").bfloat16()
    tw = torch.softmax(torch.randn(tokens, k, generator=gen, device="cuda"), -1)
    for n_local in (0, 1, tokens * k):
        is_local = (torch.arange(tokens * k, device="cuda") < n_local).view(tokens, k)
        slot = torch.arange(k, device="cuda").expand(tokens, k)  # distinct experts within a token either way
        ti = torch.where(is_local, owned[slot], others[slot]).to(torch.int32).contiguous()
        out = _poisoned_run(x, (weights, tw, ti, expert_map), cfg)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=expert_map, compute_dtype=torch.float64)
        if n_local == 0:
            assert not out.any(), "a rank with no local pair must return zeros"
        else:
            assert _rel(out, ref) < REL_TOL[torch.bfloat16], (n_local, cfg)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_sum_to_reference(tp: int, gen: torch.Generator) -> None:
    """What vLLM's TP does to our op, on the real kernel: rank r holds gate and up rows r*I/tp.. of w13 and the
    same columns of w2 (its I/tp slice, whole 16-element scale blocks); the ranks' outputs, summed (the
    all-reduce), equal the unsharded reference."""
    case = Case("tp", 8, 2, 512, 768, 37)
    q13, q2 = _layer(case, gen, "cuda")
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").bfloat16()
    tw, ti = _routing(case, gen, "cuda")
    shard = case.inter // tp
    total = torch.zeros(case.tokens, case.hidden, dtype=torch.float64, device="cuda")
    for rank in range(tp):
        rows = torch.cat(
            [
                torch.arange(rank * shard, (rank + 1) * shard),
                case.inter + torch.arange(rank * shard, (rank + 1) * shard),
            ]
        ).cuda()
        w13 = m.NVFP4Tensor(q13.packed[:, rows], q13.block_scale[:, rows], q13.global_scale)
        cols = slice(rank * shard, (rank + 1) * shard)
        w2 = m.NVFP4Tensor(
            q2.packed[..., cols.start // 2 : cols.stop // 2],
            q2.block_scale[..., cols.start // 16 : cols.stop // 16],
            q2.global_scale,
        )
        total += m.fused_moe(x, m.prepare_moe_weights(w13, w2), tw, ti).double()
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    assert _rel(total, ref) < tp * REL_TOL[torch.bfloat16]  # each rank rounds its output to bf16 once


def test_configs_agree_and_outputs_fully_written(gen: torch.Generator) -> None:
    """Every tile shape computes the same function; outputs and scratch start poisoned with NaN.  Two configs
    keep GEMM2's rows in x's dtype."""
    q13, q2, w, x, tw, ti = _problem(Case("cfg", 8, 2, 512, 512, 23), gen)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    args = (w, tw, ti, None)
    cfgs = [
        MoEKernelConfig(
            block_m, GemmConfig(block_n, num_warps=warps), GemmConfig(block_n, num_warps=warps, num_stages=stages), low
        )
        for block_m, block_n, warps, stages, low in (
            (16, 64, 4, 3, False),
            (32, 128, 4, 2, True),
            (64, 128, 8, 4, False),
            (128, 64, 8, 4, True),
        )
    ]
    assert all(cfg.is_valid(512, 512) for cfg in cfgs)
    for cfg in cfgs:
        out = _poisoned_run(x, args, cfg)
        assert _rel(out, ref) < REL_TOL[torch.bfloat16], cfg


def _graph_replays_with_new_routing(case: Case, cfg: MoEKernelConfig, gen: torch.Generator) -> None:
    """Capture one forward, replay it three times with new x and routing: each against the reference and
    bit-identical to an eager call."""
    q13, q2, w, x, tw, ti = _problem(case, gen)
    args = (w, tw, ti, None)
    fused_moe_sm90(x, *args, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_sm90(x, *args, cfg)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        logits = torch.randn(case.tokens, case.experts, generator=gen, device="cuda")
        new_w, new_ids = m.topk_softmax(logits, case.top_k)
        tw.copy_(new_w)
        ti.copy_(new_ids)
        graph.replay()
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert _rel(out, ref) < REL_TOL[torch.bfloat16]
        torch.testing.assert_close(out, fused_moe_sm90(x, *args, cfg), rtol=0, atol=0)


TRITON_NARROW_CASES = [  # (case, block_m, (block_n, warps, stages, programs per SM), narrow)
    # about 75 rows an expert: a full tile, then a last one of a few rows (16 wide) or of 17-32 (32 wide)
    (Case("Qwen3-like prefill, last tiles narrow", 16, 4, 512, 384, 300), 64, (128, 4, 3, 2), 2),
    (Case("Mixtral-like prefill, 8 warps, ragged", 8, 2, 1024, 1024, 600, "half_empty"), 128, (128, 8, 3, 2), 2),
    (Case("narrow 1 of 32, padded K", 16, 4, 768, 208, 70), 32, (64, 4, 3, 2), 1),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,block_m,shape,narrow", TRITON_NARROW_CASES, ids=lambda v: getattr(v, "why", None))
def test_triton_narrow_tiles_match_reference(case, block_m, shape, narrow, dtype, gen) -> None:
    """GemmConfig.narrow_tiles in the Triton GEMMs: a tile of at most block_m / 2 (/ 4) rows runs its loads, MMAs
    and stores that narrow.  Against the reference with outputs and scratch poisoned, and the same config at full
    width to within rounding."""
    block_n, warps, stages, pps = shape
    gemm = GemmConfig(block_n, num_warps=warps, num_stages=stages, programs_per_sm=pps)
    full = MoEKernelConfig(block_m, gemm, gemm)
    cfg = dataclasses.replace(
        full,
        gemm1=dataclasses.replace(full.gemm1, narrow_tiles=narrow),
        gemm2=dataclasses.replace(full.gemm2, narrow_tiles=narrow),
    )
    _matches_reference_and(case, dtype, gen, cfg, full)


def _matches_reference_and(
    case: Case, dtype: torch.dtype, gen: torch.Generator, cfg: MoEKernelConfig, other: MoEKernelConfig
) -> None:
    """``cfg``'s forward on a random layer of ``case`` against the float64 reference with outputs and scratch
    poisoned, and against ``other``'s (the same sums computed another way) to within rounding."""
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = _routing(case, gen, "cuda")
    padded = (-(-case.hidden // 128) * 128, -(-case.inter // 128) * 128)
    assert cfg.is_valid(*padded) and other.is_valid(*padded)
    args = (w, tw, ti, None)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    out = _poisoned_run(x, args, cfg)
    assert _rel(out, ref) < REL_TOL[dtype]
    assert _rel(out, fused_moe_sm90(x, *args, other)) < REL_TOL[dtype] / 4


def test_triton_narrow_tiles_in_a_cuda_graph(gen: torch.Generator) -> None:
    """Which width a tile runs is read from the tile map at run time: replays with new routing change it."""
    gemm = GemmConfig(128, num_warps=4, num_stages=3, programs_per_sm=2, narrow_tiles=2)
    _graph_replays_with_new_routing(Case("graph narrow", 16, 4, 512, 384, 300), MoEKernelConfig(64, gemm, gemm), gen)


TMA_CASES = [  # (case, block_m): GEMM2 on the Triton kernel reads TMA boxes
    (Case("Qwen3-like prefill, padded K, half the experts empty", 16, 4, 512, 208, 300, "half_empty"), 128),
    (Case("Mixtral-like prefill, 8 warps", 8, 2, 1024, 1024, 600), 128),
    (Case("64-token tiles, top-4", 16, 4, 512, 384, 300), 64),
]
TMA_RESIDENCY = {"one program an SM": dict(num_stages=3), "two at 128 registers": dict(num_stages=2, max_registers=128)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("residency", list(TMA_RESIDENCY))
@pytest.mark.parametrize("case,block_m", TMA_CASES, ids=lambda v: getattr(v, "why", None))
def test_triton_gemm2_boxes_match_reference(case, block_m, residency, dtype, gen) -> None:
    """The Triton GEMM2 takes its token rows and weights as TMA boxes (gemm_triton, TMA): rows past a tile's and K past
    I read as zeros and are never stored.  Uncapped (one program an SM) and at 128 registers (two, what the boxes
    made fit without spills), against the reference with outputs and scratch poisoned, and against the same tiles
    on the Gluon GEMM2 (its own loads) to within rounding."""
    gemm1 = GemmConfig(128, num_warps=8, num_stages=3, programs_per_sm=2)
    boxes = MoEKernelConfig(block_m, gemm1, dataclasses.replace(gemm1, **TMA_RESIDENCY[residency]))
    gluon = dataclasses.replace(boxes, gemm2=GemmConfig(128, num_warps=8, num_stages=2, warp_specialized=True))
    _matches_reference_and(case, dtype, gen, boxes, gluon)


def test_triton_gemm2_boxes_in_a_cuda_graph(gen: torch.Generator) -> None:
    """The boxes' coordinates come from the tile map at run time: replays with new routing move them."""
    gemm1 = GemmConfig(128, num_warps=8, num_stages=3, programs_per_sm=2)
    gemm2 = GemmConfig(128, num_warps=8, num_stages=2, programs_per_sm=2, max_registers=128)
    _graph_replays_with_new_routing(Case("graph boxes", 16, 4, 512, 208, 300), MoEKernelConfig(128, gemm1, gemm2), gen)


WS_CASES = [  # (case, block_m, (block_n, warps, stages, register cap, programs per SM, chunks per stage, K groups
    #            [, other GemmConfig fields]), which GEMMs)
    (Case("one token, both GEMMs, one program per SM", 8, 2, 2048, 448, 1), 16, (64, 4, 4, None, 1, 1, 1), 3),
    (
        Case("ragged, half the experts empty, 3 per SM", 16, 4, 512, 384, 33, "half_empty"),
        16,
        (64, 4, 6, 80, 3, 1, 1),
        3,
    ),
    (Case("every token to one expert, 2 per SM", 8, 2, 256, 512, 40, "one_expert"), 32, (128, 4, 4, 128, 2, 1, 1), 3),
    (Case("two MMA warp groups, GEMM1 only", 8, 2, 1024, 512, 19), 32, (128, 8, 4, None, 1, 1, 1), 1),
    (Case("GEMM2 only, padded K, top-8", 64, 8, 640, 208, 9), 16, (64, 4, 4, 128, 2, 1, 1), 2),
    (Case("prefill-sized tiles", 8, 2, 1024, 1024, 600), 64, (128, 4, 3, 128, 2, 1, 1), 3),
    # several K chunks per stage: one MMA left running at 128 rows per warp group, two at 64
    (
        Case("2 chunks a stage, 128 rows, padded K, ragged", 16, 4, 1024, 448, 37, "half_empty"),
        16,
        (128, 4, 2, 128, 2, 2, 1),
        3,
    ),
    (Case("4 chunks a stage, 64 rows, 2 per SM", 8, 2, 1024, 512, 5), 16, (64, 4, 2, 128, 2, 4, 1), 3),
    (Case("2 chunks a stage, two MMA warp groups", 8, 2, 512, 256, 70), 32, (128, 8, 2, None, 1, 2, 1), 3),
    # two K groups sharing each tile: 16 and 6 steps; 9 and 5 steps (each tile padded to 10 and 6) with several
    # tiles per program; 2-chunk stages, GEMM2's K padded
    (Case("2 K groups, one token", 8, 2, 2048, 768, 1), 16, (64, 4, 2, 168, 1, 1, 2), 3),
    (
        Case("2 K groups, odd step counts, several tiles per program", 8, 2, 1152, 640, 300),
        64,
        (64, 4, 4, 96, 1, 1, 2),
        3,
    ),
    (
        Case("2 K groups, 2 chunks a stage, ragged", 16, 4, 1024, 448, 37, "half_empty"),
        16,
        (128, 4, 4, 168, 1, 2, 2),
        3,
    ),
    # 8-token tiles (wgmma N=8): experts past 8 tokens take several tiles; one token; K groups
    (Case("8-token tiles, 4 chunks a stage, 2 per SM", 8, 2, 1024, 512, 33), 8, (64, 4, 2, 128, 2, 4, 1), 3),
    (
        Case("8-token tiles, ragged, padded K, top-8, one loader warp", 64, 8, 640, 208, 41, "half_empty"),
        8,
        (128, 4, 4, 128, 2, 1, 1, dict(loader_warps=1)),
        3,
    ),
    (Case("8-token tiles, one token, 2 K groups", 128, 8, 2048, 768, 1), 8, (64, 4, 4, 168, 1, 2, 2), 3),
    # narrow tiles (GemmConfig.narrow_tiles): experts of 0 to ~60 rows, so tiles of each MMA width (8, 16, 32)
    # and experts of several tiles whose last is narrow; with 2 K groups the groups must pick the same width
    (
        Case("narrow tiles 8/16/32, 2 MMA warp groups", 16, 4, 1024, 512, 40),
        32,
        (128, 8, 4, 128, 1, 2, 1, dict(narrow_tiles=2)),
        3,
    ),
    (
        Case("narrow tiles, several an expert, top-8, two loader warps", 32, 8, 640, 208, 70, "half_empty"),
        32,
        (64, 4, 4, 128, 2, 1, 1, dict(narrow_tiles=1, loader_warps=2)),
        3,
    ),
    (
        Case("narrow 8 of 16, 2 K groups, one loader warp", 64, 8, 1024, 448, 50),
        16,
        (128, 4, 4, 168, 1, 2, 2, dict(narrow_tiles=1, loader_warps=1)),
        3,
    ),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,block_m,shape,which", WS_CASES, ids=lambda v: getattr(v, "why", None))
def test_warp_specialized_matches_reference(case, block_m, shape, which, dtype, gen) -> None:
    """The warp-specialized Gluon GEMMs (sm90.gemm_gluon): a TMA loader warp group, MMA warps decoding from shared memory.
    Against the float64 reference with outputs and scratch poisoned, the full FP4 code range, ragged and
    empty experts, stages reused many times over (K up to 2048 = 16 steps through a ring of 3-6), and the
    same output as the Triton kernel with the same tiles to within rounding; stages of 1, 2 and 4 K chunks;
    tiles shared by two MMA warp groups, whose sums add in a fixed order (a second run is bit-identical);
    8-token tiles (the Triton kernel checked against runs them with 16); tiles whose MMAs run 8 or 16 tokens
    wide where the expert's rows fit; loaders of 1, 2 and 4 warps."""
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = _routing(case, gen, "cuda")
    block_n, warps, stages, regs, pps, chunks, groups, *other = shape
    ws = GemmConfig(
        block_n,
        num_warps=warps,
        num_stages=stages,
        max_registers=regs,
        programs_per_sm=pps,
        warp_specialized=True,
        chunks_per_stage=chunks,
        k_groups=groups,
        **(other[0] if other else {}),
    )
    plain = GemmConfig(block_n, num_warps=warps, num_stages=3)
    cfg = MoEKernelConfig(block_m, ws if which & 1 else plain, ws if which & 2 else plain)
    assert cfg.is_valid(-(-case.hidden // 128) * 128, -(-case.inter // 128) * 128)
    args = (w, tw, ti, None)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    out = _poisoned_run(x, args, cfg)
    assert _rel(out, ref) < REL_TOL[dtype]
    assert torch.equal(out, fused_moe_sm90(x, *args, cfg))
    triton_only = MoEKernelConfig(max(block_m, 16), plain, plain)  # 8-token tiles are Gluon-only
    assert _rel(out, fused_moe_sm90(x, *args, triton_only)) < REL_TOL[dtype] / 4


@pytest.mark.parametrize("k_groups,stages", [(2, 2), (2, 4)])
def test_k_groups_give_a_token_the_same_bits_wherever_its_tile_runs(
    k_groups: int, stages: int, gen: torch.Generator
) -> None:
    """Tiles shared by K_GROUPS MMA warp groups: a token's output bits do not depend on which tile its rows land
    in, or on that tile's place in its program's run (the routing's atomics and the token order move rows
    between an expert's tiles).  9 and 5 K steps over 2 groups (padded to 10 and 6), experts of several 64-row
    tiles, several tiles per program, rings of one and two stages a group: tokens permuted, outputs permuted bit
    for bit."""
    case = Case("permuted", 8, 2, 1152, 640, 1000)  # experts of ~4 tiles, 2-3 tiles per program
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").bfloat16()
    tw, ti = _routing(case, gen, "cuda")
    ws = GemmConfig(64, num_warps=4, num_stages=stages, max_registers=96, warp_specialized=True, k_groups=k_groups)
    cfg = MoEKernelConfig(64, ws, ws)
    assert cfg.is_valid(1152, 640)

    def forward(order: torch.Tensor) -> torch.Tensor:
        return fused_moe_sm90(x[order], w, tw[order], ti[order], None, cfg)

    out = forward(torch.arange(case.tokens, device="cuda"))
    for _ in range(3):
        perm = torch.randperm(case.tokens, generator=gen, device="cuda")
        assert torch.equal(forward(perm), out[perm])


@pytest.mark.parametrize("k_groups,block_m,narrow", [(1, 16, 0), (2, 16, 0), (1, 8, 0), (1, 32, 2)])
def test_warp_specialized_in_a_cuda_graph(k_groups: int, block_m: int, narrow: int, gen: torch.Generator) -> None:
    """Both warp-specialized GEMMs captured once (their TMA descriptors baked into the graph), replayed with
    new x and routing: the tile map is read on the device every replay (GEMM2's loader reads it and loads its
    first tile's weights before GEMM1 has ended).  With 2 K groups per tile, with 8-token tiles, and with narrow
    tiles (each replay's routing picks other widths), too."""
    # one group: two programs per SM; two: one program of two MMA groups (stages a multiple of two)
    pps, stages = (2 if k_groups == 1 else 1), (4, 2)
    ws = GemmConfig(
        64,
        num_stages=stages[0],
        max_registers=128,
        programs_per_sm=pps,
        warp_specialized=True,
        k_groups=k_groups,
        narrow_tiles=narrow,
    )
    ring = GemmConfig(
        128,
        num_stages=stages[1],
        max_registers=128,
        programs_per_sm=pps,
        warp_specialized=True,
        chunks_per_stage=2,
        k_groups=k_groups,
        narrow_tiles=narrow,
    )
    tokens = 60 if narrow else 7  # narrow: experts of ~15 rows, spread over all three widths
    _graph_replays_with_new_routing(Case("graph ws", 16, 4, 1024, 512, tokens), MoEKernelConfig(block_m, ws, ring), gen)


PAIR_CASES = [  # (case, block_m, GEMM1 and GEMM2 fields: the shipped T=1 shapes, then pairs that share experts)
    (
        Case("one token, Mixtral-like: 16-token tiles run 8 wide", 8, 2, 2048, 1024, 1),
        16,
        (
            dict(block_n=128, num_stages=2, chunks_per_stage=2, programs_per_sm=3, narrow_tiles=1, loader_warps=1),
            dict(block_n=64, num_stages=4, chunks_per_stage=4, k_groups=2, max_registers=168),
        ),
    ),
    (
        Case("one token, Qwen3-like top-8, 2 K groups", 128, 8, 2048, 768, 1),
        8,
        (
            dict(block_n=64, num_stages=4, chunks_per_stage=2, k_groups=2, max_registers=168, programs_per_sm=2),
            dict(block_n=64, num_stages=2, chunks_per_stage=2, programs_per_sm=2, loader_warps=2),
        ),
    ),
    (
        Case("9 tokens on 8 experts: pairs share experts, each its own tile", 8, 2, 512, 256, 9),
        8,
        (dict(block_n=64), dict(block_n=64)),
    ),
    (
        Case("every token to one expert, padded K, top-3", 6, 3, 640, 208, 5, "one_expert"),
        16,
        (dict(block_n=128, narrow_tiles=1), dict(block_n=64, k_groups=2, max_registers=168)),
    ),
]


def _pair_tiles_config(block_m: int, fields: tuple[dict, dict]) -> MoEKernelConfig:
    gemms = [GemmConfig(**{"max_registers": 128, **f, "warp_specialized": True}) for f in fields]
    return MoEKernelConfig(block_m, *gemms, pair_tiles=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,block_m,fields", PAIR_CASES, ids=lambda v: getattr(v, "why", None))
def test_pair_tiles_match_reference_and_routed_tiles(case, block_m, fields, dtype, gen) -> None:
    """MoEKernelConfig.pair_tiles: no routing kernel, every (token, k) pair a one-row tile whose expert the GEMMs
    read from topk_ids.  Against the float64 reference with outputs and scratch poisoned (the full FP4 code
    range), bit-identical over runs, and the same sums as the routed tiles of the same config to within
    rounding; pairs that share an expert (each streams the weights again) are still right.  With an expert map
    (the identity here) the pair tiles map each pair's expert themselves: the same bits as without."""
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = _routing(case, gen, "cuda")
    cfg = _pair_tiles_config(block_m, fields)
    assert cfg.is_valid(-(-case.hidden // 128) * 128, -(-case.inter // 128) * 128)
    args = (w, tw, ti)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    out = _poisoned_run(x, (*args, None), cfg)
    assert _rel(out, ref) < REL_TOL[dtype]
    assert torch.equal(out, fused_moe_sm90(x, *args, None, cfg))
    routed = fused_moe_sm90(x, *args, None, dataclasses.replace(cfg, pair_tiles=False))
    assert _rel(out, routed) < REL_TOL[dtype] / 4
    identity = torch.arange(case.experts, dtype=torch.int32, device="cuda")  # every expert on this rank
    assert torch.equal(fused_moe_sm90(x, *args, identity, cfg), out)


def test_pair_tiles_in_a_cuda_graph(gen: torch.Generator) -> None:
    """Pair tiles captured once and replayed with new x and routing: every replay reads the new topk_ids on the
    device (GEMM2's loader before GEMM1 has ended)."""
    cfg = _pair_tiles_config(8, PAIR_CASES[1][2])
    _graph_replays_with_new_routing(Case("graph pair tiles", 64, 8, 2048, 768, 1), cfg, gen)


def test_route_kernel_matches_torch_plan(gen: torch.Generator) -> None:
    # one program (up to 1024 pairs), counted chunks of one step (1332, 8000 pairs), of several (40000, 32768)
    for experts, top_k, tokens, block_m in (
        (8, 2, 1, 16),
        (60, 4, 333, 16),
        (128, 8, 1000, 64),
        (7, 1, 0, 32),
        (8, 2, 20000, 128),
        (256, 8, 4096, 64),
        (16, 4, 200, 32),
    ):
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen, device="cuda", dtype=torch.int32)
        sorted_pairs, counts, offsets, tile_expert, tile_row, tile_row_end, num_tiles = route(
            ids, experts, block_m, None
        )
        plan = m.plan_routing(ids, experts, block_m)
        assert torch.equal(counts, plan.expert_counts)
        assert torch.equal(offsets, plan.expert_offsets)
        assert torch.equal(tile_expert, plan.tile_expert)
        assert torch.equal(tile_row, plan.tile_row_start)
        assert torch.equal(tile_row_end, plan.tile_row_end)
        assert torch.equal(num_tiles, plan.num_tiles)
        # within an expert's run the order may differ (atomics); the sets must not
        for e in range(experts):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            assert torch.equal(sorted_pairs[lo:hi].sort().values, plan.sorted_pairs[lo:hi].sort().values)


def test_deterministic(gen: torch.Generator) -> None:
    _, _, w, x, tw, ti = _problem(Case("det", 16, 4, 512, 256, 200), gen)
    first = m.fused_moe(x, w, tw, ti)
    for _ in range(3):
        assert torch.equal(m.fused_moe(x, w, tw, ti), first)


def test_cuda_graph_replay_with_new_inputs(gen: torch.Generator) -> None:
    case = Case("graph", 16, 4, 256, 256, 24)
    q13, q2, w, x, tw, ti = _problem(case, gen)
    m.fused_moe(x, w, tw, ti)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m.fused_moe(x, w, tw, ti)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        new_w, new_ids = m.topk_softmax(torch.randn(case.tokens, 16, generator=gen, device="cuda"), 4)
        tw.copy_(new_w)
        ti.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, m.fused_moe(x, w, tw, ti), rtol=0, atol=0)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert _rel(out, ref) < REL_TOL[torch.bfloat16]


def test_torch_compile(gen: torch.Generator) -> None:
    _, _, w, x, tw, ti = _problem(Case("compile", 8, 2, 256, 256, 17), gen)

    @torch.compile(fullgraph=True)
    def layer(x, tw, ti):
        return m.fused_moe(x * 2, w, tw, ti) + 1

    torch.testing.assert_close(layer(x, tw, ti), m.fused_moe(x * 2, w, tw, ti) + 1, rtol=0, atol=0)


def test_warmup_leaves_nothing_to_compile(gen: torch.Generator) -> None:
    """After warmup_fused_moe(max_tokens), no T <= max_tokens compiles a kernel (vLLM serves any T)."""
    case = Case("warm", 24, 3, 256, 128, 0)  # no tuned entry: the default's configs (bounds 2, 39, 79, ... 384)
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    # routing: one program of 128 pairs to T=42, of 1024 to T=341, counted chunks past (routing_variants_from)
    assert torch.cuda.get_device_properties(0).multi_processor_count == 132, "the counts below are for 132 SMs"
    assert m.warmup_fused_moe(w, 3, torch.bfloat16, 700) == [1, 3, 40, 43, 80, 160, 256, 342, 385]
    before = compiled_variants()
    assert before > 0
    for t in (1, 2, 5, 16, 42, 43, 45, 100, 135, 136, 257, 263, 264, 341, 342, 511, 699, 700):
        x = torch.randn(t, case.hidden, generator=gen, device="cuda").bfloat16()
        tw, ti = m.topk_softmax(torch.randn(t, case.experts, generator=gen, device="cuda"), case.top_k)
        out = m.fused_moe(x, w, tw, ti)
        assert compiled_variants() == before, f"T={t} compiled a new kernel variant"
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert _rel(out, ref) < REL_TOL[torch.bfloat16], t


def test_bad_inputs_fail_before_launch(gen: torch.Generator) -> None:
    case = Case("bad", 4, 2, 128, 128, 3)
    q13, q2 = _layer(case, gen, "cuda")
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(3, 128, device="cuda").bfloat16()
    tw, ti = m.topk_softmax(torch.randn(3, 4, device="cuda"), 2)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        m.fused_moe(x.float(), w, tw, ti)
    with pytest.raises(ValueError, match=r"x must be \[T, 128\]"):
        m.fused_moe(x[:, :64], w, tw, ti)
    with pytest.raises(ValueError, match="one device"):
        m.fused_moe(x, w, tw.cpu(), ti.cpu())


@triton.jit
def _silu_times_kernel(gate_ptr, up_ptr, out_ptr, n, USE_ASM: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    ok = offs < n
    y = _silu_times(tl.load(gate_ptr + offs, mask=ok), tl.load(up_ptr + offs, mask=ok), USE_ASM)
    tl.store(out_ptr + offs, y, mask=ok)


def test_gated_activation_is_silu_times_up_to_fp32_rounding(gen: torch.Generator) -> None:
    """The epilogues' SiLU(gate) * up (ex2 and rcp.approx on the GPU) against float64 over the whole range a gate
    takes: zero, tiny, ordinary, and past where 2^(-gate log2 e) overflows (SiLU -> 0) or underflows (SiLU ->
    gate).  Bound, relative to max(|ref|, 1e-28): a few fp32 ulps plus the rounding of gate * log2 e to fp32,
    which the exponential magnifies to about |gate| 2^-24 (tl.exp rounds the same way), so 5.3e-6 at the
    largest gates that do not flush: far below the bf16 / fp16 rounding that follows.  Values under fp32's
    smallest normal may flush to zero."""
    mags = torch.cat(
        [
            torch.zeros(1, device="cuda"),
            torch.logspace(-30, 2.2, 4000, device="cuda"),
            torch.rand(20000, device="cuda", generator=gen) * 30,
        ]
    )
    gate = torch.cat([mags, -mags])
    up = torch.randn(gate.shape, device="cuda", generator=gen) * 3
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    for use_asm in (True, False):  # the GPU's instructions, and the formula the interpreter runs
        out = torch.full_like(gate, float("nan"))
        _silu_times_kernel[(triton.cdiv(gate.numel(), 1024),)](gate, up, out, gate.numel(), USE_ASM=use_asm)
        err = (out.double() - ref).abs() / ref.abs().clamp_min(1e-28)
        bound = 4e-7 + gate.double().abs() * 2.0**-24
        assert (err < bound).all(), (use_asm, gate[(err / bound).argmax()].item(), (err / bound).max().item())


SHIPPED_ENTRIES = [
    (path, entry)
    for path in sorted((CONFIG_DIR / KERNEL_NAME).glob("*.json"))
    for entry in load_config_file(str(path))[1]
]


@pytest.mark.parametrize(
    "path,entry",
    SHIPPED_ENTRIES,
    ids=[
        f"{p.stem}-E{e['experts']}-H{e['hidden']}-I{e['intermediate']}-T{e['max_tokens']}" for p, e in SHIPPED_ENTRIES
    ],
)
def test_shipped_configs_match_reference(path: Path, entry: dict, gen: torch.Generator) -> None:
    """Every tuned entry this GPU would select, at its own model shape and at the largest token count it serves
    (most tiles, ragged last tiles per expert), with outputs and scratch poisoned, against the float64 reference
    on the same NVFP4 weights (the full FP4 code range).  Entries of files that do not serve this GPU
    (tuned_configs.tuned_file_for) are skipped: a re-tune is checked on the GPU it was tuned for."""
    serving = tuned_file_for(device_traits(torch.device("cuda")))
    if serving is None or serving.resolve() != path.resolve():
        pytest.skip(f"entry of {path.name}, which does not serve {torch.cuda.get_device_name()}")
    experts, hidden, inter, tokens = entry["experts"], entry["hidden"], entry["intermediate"], entry["max_tokens"]
    case = Case("shipped", experts, entry["top_k"], hidden, inter, tokens)
    cfg = MoEKernelConfig.from_dict(entry["config"])
    dtype = getattr(torch, entry["dtype"])
    q13, q2, w, x, tw, ti = _problem(case, gen, dtype)
    args = (w, tw, ti, None)
    out = _poisoned_run(x, args, cfg)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
    assert _rel(out, ref) < REL_TOL[dtype], cfg


@triton.jit
def _swiglu_oai_kernel(gate_ptr, up_ptr, out_ptr, n, ALPHA: tl.constexpr, LIMIT: tl.constexpr, USE_ASM: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    ok = offs < n
    y = _swiglu_oai(tl.load(gate_ptr + offs, mask=ok), tl.load(up_ptr + offs, mask=ok), ALPHA, LIMIT, USE_ASM)
    tl.store(out_ptr + offs, y, mask=ok)


def test_swiglu_oai_is_vllms_up_to_fp32_rounding(gen: torch.Generator) -> None:
    """The epilogue's clamped SwiGLU against float64 ExpertActivation.torch_twin (vLLM's definition) over gates and ups
    on both sides of the clamp.  Bound as the SiLU test's (the exponent's argument being alpha * gate), relative to
    |g sigmoid(alpha g)| (|u| + 1): up + 1 rounds in fp32, which near up = -1 is large against the result alone."""

    gate = torch.cat(
        [torch.logspace(-20, 1.5, 3000, device="cuda"), torch.rand(20000, device="cuda", generator=gen) * 20]
    )
    gate = torch.cat([gate, -gate])
    up = torch.randn(gate.shape, device="cuda", generator=gen) * 10
    act = m.SWIGLU_OAI
    ref = act.torch_twin(torch.cat([gate, up]).double().view(2, -1).T.reshape(-1, 2)).reshape(-1)
    assert (gate > act.limit).any() and (up.abs() > act.limit).any()
    for use_asm in (True, False):
        out = torch.full_like(gate, float("nan"))
        _swiglu_oai_kernel[(triton.cdiv(gate.numel(), 1024),)](
            gate, up, out, gate.numel(), ALPHA=act.alpha, LIMIT=act.limit, USE_ASM=use_asm
        )
        g, u = gate.double().clamp(max=act.limit), up.double().clamp(-act.limit, act.limit)
        err = (out.double() - ref).abs() / (g * torch.sigmoid(act.alpha * g) * (u.abs() + 1)).abs().clamp_min(1e-28)
        bound = 6e-7 + (act.alpha * g).abs() * 2.0**-24
        assert (err < bound).all(), (use_asm, gate[(err / bound).argmax()].item(), (err / bound).max().item())


@dataclass(frozen=True)
class Variant:
    why: str
    activation: m.ExpertActivation
    bias: bool
    on_input: bool
    experts: int
    top_k: int
    hidden: int
    inter: int


VARIANTS = [
    Variant("silu, biases", m.SILU, True, False, 32, 4, 1024, 512),
    Variant("silu, router weight on input, top-1 (Llama-4)", m.SILU, False, True, 16, 1, 1024, 768),
    Variant("swiglu_oai, biases (gpt-oss)", m.SWIGLU_OAI, True, False, 32, 4, 768, 384),
    Variant("swiglu_oai, biases, router weight on input, top-2", m.SWIGLU_OAI, True, True, 16, 2, 512, 256),
    Variant("relu2, non-gated, top-6 (Nemotron-3-Nano, 16 experts)", m.RELU2, False, False, 16, 6, 2688, 1856),
    Variant("relu2, biases, K padded", m.RELU2, True, False, 12, 3, 400, 208),
]


def _variant_problem(v: Variant, tokens: int, dtype: torch.dtype, gen: torch.Generator):
    """Random NVFP4 experts (the full FP4 code range; GEMM1 rows of about 4 standard deviations, so swiglu_oai's
    clamp is reached), biases, x and sigmoid-like routing weights below one."""
    rows = 2 * v.inter if v.activation.gated else v.inter
    w13 = torch.randn(v.experts, rows, v.hidden, generator=gen, device="cuda") * 4 / v.hidden**0.5
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6], device="cuda") / 6
    w13[..., :16] = grid * w13.abs().amax(-1, keepdim=True)
    q13 = m.quantize_nvfp4(w13, segments=2 if v.activation.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(v.experts, v.hidden, v.inter, generator=gen, device="cuda") / v.inter**0.5)
    b13 = torch.randn(v.experts, rows, generator=gen, device="cuda") if v.bias else None
    b2 = torch.randn(v.experts, v.hidden, generator=gen, device="cuda") if v.bias else None
    w = m.prepare_moe_weights(q13, q2, activation=v.activation, w13_bias=b13, w2_bias=b2)
    x = torch.randn(tokens, v.hidden, generator=gen, device="cuda").to(dtype)
    tw, ti = m.topk_softmax(torch.randn(tokens, v.experts, generator=gen, device="cuda"), v.top_k, renormalize=False)
    return q13, q2, b13, b2, w, x, tw, ti


def _variant_reference(v: Variant, q13, q2, b13, b2, x, tw, ti) -> torch.Tensor:
    return m.fused_moe_torch(
        x,
        q13,
        q2,
        tw,
        ti,
        activation=v.activation,
        w13_bias=b13,
        w2_bias=b2,
        apply_router_weight_on_input=v.on_input,
        compute_dtype=torch.float64,
    )


# the dispatcher's paths: pair tiles (T=1), the Gluon decode tiles (T=4..64), prefill tiles (T >= 256)
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("v", VARIANTS, ids=[v.why for v in VARIANTS])
def test_variants_match_reference(v: Variant, dtype: torch.dtype, tokens: int, gen: torch.Generator) -> None:
    """Each variant through fused_moe (the host wrapper picks the config) on every path the dispatcher takes,
    against the float64 reference (REL_TOL); the config the host picked is the path this test names."""
    from moe_nvfp4.sm90.tuned_configs import select_config

    q13, q2, b13, b2, w, x, tw, ti = _variant_problem(v, tokens, dtype, gen)
    cfg = select_config(tokens, w.layer_shape(v.top_k, dtype), device_traits(x.device))
    if tokens == 1:
        assert cfg.pair_tiles
    elif tokens <= 64:
        assert not cfg.pair_tiles and cfg.gemm1.warp_specialized
    else:
        assert cfg.block_m >= 64
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # freed scratch the forward may reuse: poisoned
    out = m.fused_moe(x, w, tw, ti, apply_router_weight_on_input=v.on_input)
    assert not out.isnan().any()
    assert _rel(out, _variant_reference(v, q13, q2, b13, b2, x, tw, ti)) < REL_TOL[dtype], cfg


@pytest.mark.parametrize("v", [VARIANTS[3], VARIANTS[5]], ids=[VARIANTS[3].why, VARIANTS[5].why])
@pytest.mark.parametrize("block_m,which", [(16, "triton"), (16, "ws"), (128, "triton"), (64, "ws")])
def test_variants_on_both_kernel_families(v: Variant, block_m: int, which: str, gen: torch.Generator) -> None:
    """The same variant on the Triton and the Gluon GEMMs at explicit tiles (the dispatcher picks one family per
    tile), with an expert map routing two global experts elsewhere, against the reference."""
    ws = which == "ws"
    gemm = GemmConfig(128, num_warps=4, num_stages=3, warp_specialized=ws, max_registers=128 if ws else None)
    cfg = MoEKernelConfig(block_m, gemm, gemm)
    q13, q2, b13, b2, w, x, tw, ti = _variant_problem(v, 97, torch.bfloat16, gen)
    assert w.layer_shape(v.top_k, torch.bfloat16).accepts(cfg)
    emap = torch.arange(v.experts, dtype=torch.int32, device="cuda")
    emap[0] = emap[-1] = -1  # global experts 0 and E - 1 on another rank
    out = torch.full_like(x, float("nan"))
    fused_moe_sm90(x, w, tw, ti, emap, cfg, out=out, apply_router_weight_on_input=v.on_input)
    ref = m.fused_moe_torch(
        x,
        q13,
        q2,
        tw,
        ti,
        expert_map=emap,
        activation=v.activation,
        w13_bias=b13,
        w2_bias=b2,
        apply_router_weight_on_input=v.on_input,
        compute_dtype=torch.float64,
    )
    assert _rel(out, ref) < REL_TOL[torch.bfloat16], cfg


@pytest.mark.parametrize("tokens", [1, 16])
def test_variants_in_a_cuda_graph(tokens: int, gen: torch.Generator) -> None:
    """swiglu_oai with biases and the router weight on the input (its pre-pass included), and relu2, captured once
    through fused_moe and replayed with new x and routing."""
    for v in (VARIANTS[3], VARIANTS[5]):
        q13, q2, b13, b2, w, x, tw, ti = _variant_problem(v, tokens, torch.bfloat16, gen)
        m.fused_moe(x, w, tw, ti, apply_router_weight_on_input=v.on_input)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m.fused_moe(x, w, tw, ti, apply_router_weight_on_input=v.on_input)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
            new_w, new_ids = m.topk_softmax(torch.randn(tokens, v.experts, generator=gen, device="cuda"), v.top_k)
            tw.copy_(new_w)
            ti.copy_(new_ids)
            graph.replay()
            torch.testing.assert_close(
                out, m.fused_moe(x, w, tw, ti, apply_router_weight_on_input=v.on_input), rtol=0, atol=0
            )
            assert _rel(out, _variant_reference(v, q13, q2, b13, b2, x, tw, ti)) < REL_TOL[torch.bfloat16]


def test_nemotron3_nano_layer(gen: torch.Generator) -> None:
    """Nemotron-3-Nano's MoE layer (zoo: E=128, top-6, H=2688, I=1856, relu2, non-gated) at decode and prefill."""
    v = Variant("nemotron-3-nano", m.RELU2, False, False, 128, 6, 2688, 1856)
    for tokens in (1, 16, 512):
        q13, q2, b13, b2, w, x, tw, ti = _variant_problem(v, tokens, torch.bfloat16, gen)
        out = m.fused_moe(x, w, tw, ti)
        assert _rel(out, _variant_reference(v, q13, q2, b13, b2, x, tw, ti)) < REL_TOL[torch.bfloat16], tokens
