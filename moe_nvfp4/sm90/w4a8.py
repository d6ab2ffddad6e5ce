"""The W4A8 mode on sm_90 (issue 58, design 008): the NVFP4 experts folded once into an e4m3 copy, token rows
quantized to e4m3 per row on the fly, both GEMMs on FP8 wgmma (gemm_fp8).

Why a folded copy and not an in-kernel decode: one FP8 MMA (K = 32) spans two 16-element blocks, so the block
scales cannot be applied inside it (design 008, decision 1), and folding them in the K loop costs a multiply and a
conversion per value on the path that already bounds the W4A16 kernel at prefill.  The copy costs one byte per
weight value (about 1.8x the NVFP4 bytes) and is opt-in.

Roundings (the pure-torch twin ``fused_moe_w4a8_torch`` applies the same ones):
  weights: code x block scale x global scale / 2^p rounded to e4m3 (round to nearest even), 2^p per weight row
           the power of two that puts the row's largest value in [224, 448];
  rows:    x * (448 / amax) rounded to e4m3 per token row (scale amax / 448; an all-zero row stays zero), for x and
           for GEMM1's output (rounded to x's dtype first, as the W4A16 path stores it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import host_cost_counts, sm_count
from ..formats import NVFP4Tensor, dequantize_nvfp4
from ..layouts import next_pow2
from ..routing import routed_pairs
from ..shapes import LayerShape
from ..triton.combine import combine
from ..triton.launcher import launch
from ..triton.quant_act import _round_e4m3
from ..triton.routing_kernels import route
from ..weight_layouts import interleave_gate_up, interleaved_gate_up_rows
from ..weights import Fp8ExpertWeights, MoEWeights
from .common import Epilogue, GemmRouting
from .gemm_fp8 import Fp8GemmOperands, Fp8Tiles, launch_fp8_gemm
from .gemm_fp8_ws import launch_fp8_ws

__all__ = [
    "FP8_MIN_EAGER_FLOPS",
    "FP8_MIN_ROWS_PER_EXPERT",
    "Fp8Config",
    "expected_flops",
    "fold_to_fp8",
    "fp8_copy_bytes",
    "fp8_first_tokens",
    "fp8_pays",
    "fused_moe_w4a8",
    "fused_moe_w4a8_entry",
    "fused_moe_w4a8_reference",
    "fused_moe_w4a8_torch",
    "quantize_rows_fp8",
    "quantize_rows_fp8_torch",
]

E4M3_MAX = 448.0
QUANTIZE_VALUES = 4096  # values a row-quantizer program takes: whole rows, several where rows are short


# The expected rows an expert (tokens x top-k / global experts) from which the W4A8 forward runs; below it the W4A16
# one does.  H200, cooperative Gluon kernel against W4A16 in one process (design 008 decision 8): Qwen3-30B T=1024
# (64 rows) 0.94-0.98x, Kimi-K2 TP=8 T=4096 (85 rows) 1.14x, 256 rows and more 1.20-1.40x; Llama-4-Maverick TP=8
# T=1024 (8 rows) 0.48x.
FP8_MIN_ROWS_PER_EXPERT = 80

# The least work (both GEMMs' operations over the pairs a rank expects) at which an eager forward runs W4A8: its
# host time (eight launches, the two GEMMs' with TMA descriptors) is above the W4A16 forward's (enqueued in 406-871
# against 314-695 us on the H200 host), so it pays only where the GPU work hides it.  Eager layers of Qwen3-30B-A3B,
# Qwen3-Next, OLMoE and Mixtral, both modes interleaved in one process (design 008 decision 13): where the rows
# bound alone ran W4A8 under 200 GFLOP, 0.59-1.03x (OLMoE T=1024 0.59x); from 200 up 1.06-1.86x on all 17 rows.  A
# forward captured into a CUDA graph (vLLM's decode and small prefills) replays with no host time: the rows bound.
FP8_MIN_EAGER_FLOPS = 200e9


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 GEMMs' tiles (gemm_fp8.Fp8Tiles), one set for both GEMMs: block_m token rows (the routing's tile
    rows), block_k K a step, num_stages loads in flight; 128 weight rows a tile.  warp_specialized: the Gluon
    kernel on a GPU (gemm_fp8_ws, the shipped one: a loader warp, two MMA warp groups on every tile); off, or off a
    GPU, gemm_fp8's plain Triton loop (the interpreter's stand-in: the same sums), which the GPU tests and
    tools/ab_moe.py compare with it.  The defaults are what the mode runs (design 008, decisions 7 and 9)."""

    block_m: int = 128
    block_k: int = 128
    num_stages: int = 4
    warp_specialized: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (
            ("block_m", (16, 32, 64, 128, 256)),
            ("block_k", (64, 128, 256)),
            ("num_stages", (1, 2, 3, 4, 5, 6, 7, 8)),
            ("warp_specialized", (True, False)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Fp8Config.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.warp_specialized and not (32 <= self.block_m <= 128 and self.block_k <= 128 and self.num_stages >= 2):
            raise ValueError(
                "Fp8Config.warp_specialized takes 32 <= block_m <= 128, block_k <= 128 and num_stages >= 2 (gemm_fp8_ws: "
                "each MMA warp group takes half the token rows, at most 64, into two accumulators, and holds two ring "
                f"stages while it adds one's sums), got block_m={self.block_m}, block_k={self.block_k}, "
                f"num_stages={self.num_stages}"
            )

    @property
    def tiles(self) -> Fp8Tiles:
        return Fp8Tiles(*(getattr(self, f) for f in Fp8Tiles._fields))

    def launcher(self, on_gpu: bool):
        """The launch of both GEMMs: the Gluon kernel where asked for and on a GPU (Gluon has no interpreter), else
        gemm_fp8's, which computes the same sums."""
        return launch_fp8_ws if self.warp_specialized and on_gpu else launch_fp8_gemm


FOLD_CHUNK_BYTES = 256 << 20  # float32 temporaries of one fold step: experts are dequantized this many bytes at a time


def _fold(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized weights [..., N, K] (float32, exact) -> (e4m3 bytes [..., N, K], float32 row scales [..., N]):
    each row divided by the power of two that puts its amax in [224, 448] (exact), then rounded to e4m3."""
    amax = weights.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / E4M3_MAX)))
    return (weights / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8), scale.float()


def _fold_matrix(q: NVFP4Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stack of expert matrices [E, >= n, >= k] folded, a run of experts at a time (FOLD_CHUNK_BYTES)."""
    e = q.packed.shape[0]
    codes = torch.empty(e, n, k, dtype=torch.uint8, device=q.packed.device)
    scale = torch.empty(e, n, dtype=torch.float32, device=q.packed.device)
    run = max(1, FOLD_CHUNK_BYTES // (4 * q.n * q.k))
    for x in range(0, e, run):
        part = NVFP4Tensor(
            q.packed[x : x + run], q.block_scale[x : x + run], q.global_scale[x : x + run], q.scale_layout
        )
        codes[x : x + run], scale[x : x + run] = _fold(dequantize_nvfp4(part)[:, :n, :k])
    return codes, scale


def fold_to_fp8(weights: MoEWeights, nvfp4: tuple[NVFP4Tensor, NVFP4Tensor] | None = None) -> Fp8ExpertWeights:
    """Fold ``weights`` (any layout) into the e4m3 copy.  ``nvfp4``: the (w13, w2) checkpoint tensors they were
    packed from, which spares unpacking the layout (most of the time on a CPU core: MoEWeights.to_nvfp4).  Padding
    rows and columns are dropped; a gated w13 is then interleaved."""
    w13_q, w2_q = weights.to_nvfp4() if nvfp4 is None else nvfp4
    i, gated = weights.intermediate, weights.activation.gated
    codes13, scale13 = _fold_matrix(w13_q, (2 if gated else 1) * i, weights.hidden)
    if gated:
        codes13, scale13 = interleave_gate_up(codes13, i), interleave_gate_up(scale13, i)
    codes2, scale2 = _fold_matrix(w2_q, weights.hidden, i)
    return Fp8ExpertWeights(
        codes13.view(torch.float8_e4m3fn), scale13, codes2.view(torch.float8_e4m3fn), scale2, source=weights
    )


# the row count is T or T x top-k: not specialized on (T % 16 == 0 or not would be two variants, one of them first
# compiled mid-serving: a 1.7x TTFT hit in vLLM's prefill-heavy serving bench, 2026-11-29)
@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    scale_ptr,
    n_rows,
    k,
    count_ptr,
    COUNTED: tl.constexpr,
    HW_CAST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """ROWS rows of x a program: each row's amax, then x * (448 / amax) rounded to e4m3 (round to nearest even; IEEE
    division, as the twin's); scale amax / 448.  HW_CAST: the GPU's float8 conversion (cvt.rn.satfinite, two values
    an instruction); without it the rounding on the float32 bits (quant_act._round_e4m3), for the interpreter, whose
    float8 cast rounds wrongly: the bit rounding made this kernel ALU-bound on an H200 (111 us of a 770-us Qwen3-30B
    forward).  COUNTED: only rows r < count[0].  Several rows a program where rows are short (GEMM2's input, I
    values): one 768-value row a program took 50 us at Qwen3-30B T=4096, a third of the copy rate."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    if COUNTED:
        live &= rows < tl.load(count_ptr)
    offs = tl.arange(0, BLOCK)
    mask = live[:, None] & (offs < k)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full([ROWS], 448.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
    q = x * inv[:, None]
    clamped = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if HW_CAST:
        byte = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        _, byte = _round_e4m3(tl.abs(clamped))
        byte = byte | ((q.to(tl.int32, bitcast=True) >> 24) & 0x80)
    byte = tl.where(q != q, 0x7F, byte)
    tl.store(out_ptr + rows[:, None] * k + offs[None, :], byte.to(tl.uint8), mask=mask)
    # a NaN makes the row's scale NaN, as the twin's amax: the row's sums are NaN whatever the MMA makes of 0x7F
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where(has_nan, float("nan"), tl.math.div_rn(amax, tl.full([ROWS], 448.0, tl.float32)))
    tl.store(scale_ptr + rows, scale, mask=live)


@triton.jit
def _gather_rows_kernel(
    src_ptr, src_scale_ptr, out_ptr, out_scale_ptr, pairs_ptr, count_ptr, top_k, k, BLOCK: tl.constexpr
):
    """Output row r < count[0]: the quantized row of token pairs[r] // top_k and its scale (bytes copied)."""
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(count_ptr):
        return
    token = (tl.load(pairs_ptr + row) // top_k).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * k + offs, tl.load(src_ptr + token * k + offs, mask=offs < k), mask=offs < k)
    tl.store(out_scale_ptr + row, tl.load(src_scale_ptr + token))


def quantize_rows_fp8(
    x: torch.Tensor, *, src: torch.Tensor | None = None, top_k: int = 1, count: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit stride along K) -> (e4m3 [R, K] contiguous, float32 [R]).  Without ``src``: R = T, row r
    x's row r quantized (with ``count`` int32 [1] only rows r < count[0]: the routed rows of GEMM2's input).
    ``src`` int32 [P] and ``count`` (GEMM1's token rows in sorted-pair order, route()'s sorted_pairs and routed
    count): R = P, row r < count[0] the quantized row of token src[r] // top_k.  Rows past the count are left
    unwritten (they belong to no tile).  Each token row is quantized once and its bytes gathered after:
    top_k times fewer conversions and 1-byte instead of 2-byte gathered reads."""
    t, k = x.shape
    out = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, dtype=torch.float32, device=x.device)
    block = next_pow2(k)
    rows_per_program = max(1, QUANTIZE_VALUES // block)
    if t:
        launch(
            _quantize_rows_kernel,
            (-(-t // rows_per_program),),
            x,
            x.stride(0),
            out.view(torch.uint8),
            scale,
            t,
            k,
            scale if count is None or src is not None else count,  # an unread stand-in where not counted
            COUNTED=count is not None and src is None,
            HW_CAST=x.is_cuda,
            ROWS=rows_per_program,
            BLOCK=block,
            num_warps=8 if block * rows_per_program > 4096 else 4,
        )
    if src is None:
        return out, scale
    assert count is not None, "gathered rows need the routed count"
    rows = src.numel()
    gathered = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    gathered_scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        launch(
            _gather_rows_kernel,
            (rows,),
            out.view(torch.uint8),
            scale,
            gathered.view(torch.uint8),
            gathered_scale,
            src,
            count,
            top_k,
            k,
            BLOCK=block,
            num_warps=4,
        )
    return gathered, gathered_scale


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of quantize_rows_fp8 (same operations, same roundings)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # divisions in float64, rounded once to float32: IEEE float32 division on every device (CUDA torch divides
    # by a scalar through its reciprocal, which moved ties on an H200)
    inv = torch.where(amax > 0, (E4M3_MAX / amax.double().clamp_min(1e-30)).float(), 0.0)
    return (xf * inv[:, None]).to(torch.float8_e4m3fn), (amax.double() / E4M3_MAX).float()


def _epilogues(weights: MoEWeights) -> tuple[Epilogue, Epilogue]:
    return Epilogue.of(weights.w13_bias, weights.activation), Epilogue.of(weights.w2_bias, None)


def fused_moe_w4a8(
    x: torch.Tensor,
    fp8: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """The MoE forward in the W4A8 mode: x [T, H] bf16/fp16, routing as api.fused_moe's (checked by the caller).
    Five launches (+ routing): quantize x, GEMM1, quantize the activation, GEMM2, combine."""
    weights = fp8.source
    t, top_k = topk_ids.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    config = config or Fp8Config()
    sorted_pairs, _, offsets, *tiles = route(topk_ids, weights.num_experts, config.block_m, expert_map)
    routing = GemmRouting((sorted_pairs, *tiles), topk_ids.reshape(-1), expert_map, False)
    routed = offsets[weights.num_experts :]  # rows past it belong to no tile
    epilogue1, epilogue2 = _epilogues(weights)
    sms = sm_count(x.device, off_gpu=2)
    x8, x_scale = quantize_rows_fp8(x, src=sorted_pairs, top_k=top_k, count=routed)
    act = torch.empty(t * top_k, weights.intermediate, dtype=x.dtype, device=x.device)
    gemm1 = Fp8GemmOperands(x8, x_scale, fp8.w13, fp8.w13_scale, weights.intermediate)
    run_gemm = config.launcher(x.is_cuda)
    run_gemm(gemm1, act, routing, config.tiles, epilogue1, is_gemm1=True, sms=sms)
    act8, act_scale = quantize_rows_fp8(act, count=routed)
    # each pair's row in x's dtype (as W4A16 at top-k > 2; the combine weights it): the combine reads half the bytes
    # (230 of about 2000 us at Kimi-K2 TP=8 T=4096 in float32), and the rounding (2^-9 of a row) is under a tenth of
    # the mode's error
    partial = torch.empty(t * top_k, weights.hidden, dtype=x.dtype, device=x.device)
    gemm2 = Fp8GemmOperands(act8, act_scale, fp8.w2, fp8.w2_scale, weights.hidden)
    run_gemm(gemm2, partial, routing, config.tiles, epilogue2, is_gemm1=False, sms=sms)
    combine(partial, topk_ids, expert_map, weights.num_experts, out, topk_weights)
    return out


def fused_moe_w4a8_torch(
    x: torch.Tensor,
    fp8: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch twin of fused_moe_w4a8: the same e4m3 operands and scales, float32 sums, the activation rounded
    to x's dtype before its e4m3 rounding, each pair's row rounded to x's dtype, then weighted in float32 and summed
    over top-k; pairs routed nowhere add nothing."""
    weights = fp8.source
    x8, x_scale = quantize_rows_fp8_torch(x)
    xq = x8.float() * x_scale[:, None]
    w13, w13_scale = fp8.w13_rows()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local, routed = routed_pairs(topk_ids, weights.num_experts, expert_map)
    ids = torch.where(routed, local, -1).view(topk_ids.shape)
    for e in range(weights.num_experts):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = xq[token] @ (w13[e].float() * w13_scale[e][:, None]).T
        if weights.w13_bias is not None:
            h = h + weights.w13_bias[e]
        a8, a_scale = quantize_rows_fp8_torch(weights.activation.torch_twin(h).to(x.dtype))
        y = (a8.float() * a_scale[:, None]) @ (fp8.w2[e].float() * fp8.w2_scale[e][:, None]).T
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[e]
        out.index_add_(0, token, y.to(x.dtype).float() * topk_weights[token, slot].float()[:, None])
    return out.to(x.dtype)


def fp8_copy_bytes(weights: MoEWeights) -> int:
    """Bytes fold_to_fp8 allocates for ``weights`` (the memory the opt-in mode costs on top of the NVFP4 copy)."""
    i = weights.intermediate
    n13 = interleaved_gate_up_rows(i) if weights.activation.gated else i
    values = weights.num_experts * (n13 * weights.hidden + weights.hidden * weights.intermediate)
    return values + 4 * weights.num_experts * (n13 + weights.hidden)


def fp8_pays(tokens: int, shape: LayerShape, apply_router_weight_on_input: bool, eager: bool) -> bool:
    """Whether a forward with an e4m3 copy at hand runs W4A8: experts expecting FP8_MIN_ROWS_PER_EXPERT rows or more
    (no host sync: the expectation, not the routing's counts), no router weight on the input (Llama-4's top-1; the
    W4A8 forward does not scale its rows), and, for an ``eager`` forward (dispatch.host_cost_counts: not one being
    captured into a CUDA graph, not under dispatch.choose_as_captured), FP8_MIN_EAGER_FLOPS of expected work on this rank."""
    if apply_router_weight_on_input or tokens < fp8_first_tokens(shape.top_k, shape.global_experts):
        return False
    return not eager or expected_flops(tokens, shape) >= FP8_MIN_EAGER_FLOPS


def expected_flops(tokens: int, shape: LayerShape) -> float:
    """Both GEMMs' floating-point operations over the (token, expert) pairs this rank expects at ``tokens`` (its
    local share of the global experts, uniform routing)."""
    return shape.local_pairs(tokens) * shape.flops_per_pair()


def fp8_first_tokens(top_k: int, global_experts: int) -> int:
    """The fewest tokens whose pairs give each expert FP8_MIN_ROWS_PER_EXPERT rows: where fp8_pays starts under
    CUDA-graph capture and in the warm-up (its W4A8 forward: one config, so it compiles the kernels every later T
    runs, captured or eager)."""
    return -(-FP8_MIN_ROWS_PER_EXPERT * global_experts // top_k)


def _w4a8_or_w4a16(w4a8, w4a16, x, fp8, topk_weights, topk_ids, expert_map, apply_router_weight_on_input):
    shape = fp8.source.layer_shape(topk_ids.shape[1], x.dtype, expert_map)
    if fp8_pays(x.shape[0], shape, apply_router_weight_on_input, eager=host_cost_counts(x)):
        return w4a8(x, fp8, topk_weights, topk_ids, expert_map)
    return w4a16(
        x, fp8.source, topk_weights, topk_ids, expert_map, apply_router_weight_on_input=apply_router_weight_on_input
    )


def fused_moe_w4a8_entry(
    x: torch.Tensor,
    weights: MoEWeights,
    fp8_tensors: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    *,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The Triton backend's ``moe_w4a8`` entry (backends.py): ``fp8_tensors`` (Fp8ExpertWeights.tensors folded from
    ``weights``) through the W4A8 forward where fp8_pays, else ``weights`` through the W4A16 one.  Fp8Config's
    defaults: the Gluon kernel on a GPU (gemm_fp8_ws, 128-token tiles), gemm_fp8's under the interpreter."""
    from .host import fused_moe_sm90

    fp8 = Fp8ExpertWeights(*fp8_tensors, source=weights)
    return _w4a8_or_w4a16(
        fused_moe_w4a8, fused_moe_sm90, x, fp8, topk_weights, topk_ids, expert_map, apply_router_weight_on_input
    )


def fused_moe_w4a8_reference(
    x: torch.Tensor,
    weights: MoEWeights,
    fp8_tensors: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    *,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The torch backend's ``moe_w4a8`` entry: the same choice as fused_moe_w4a8_entry, on the pure-torch twins."""
    from ..reference import fused_moe_packed_torch

    fp8 = Fp8ExpertWeights(*fp8_tensors, source=weights)
    return _w4a8_or_w4a16(
        fused_moe_w4a8_torch,
        fused_moe_packed_torch,
        x,
        fp8,
        topk_weights,
        topk_ids,
        expert_map,
        apply_router_weight_on_input,
    )
