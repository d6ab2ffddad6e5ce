"""Fused NVFP4 MoE for Hopper (sm_90) in Triton: routing, two persistent grouped GEMMs, a fixed-order combine.

Launches per forward (each grid sized from the SM count or T, never from routing data):
  1. ``_route_kernel``   per-expert counts/offsets, pairs grouped by expert, the tile map: one program up
     to ROUTE_ONE_PROGRAM pairs; past that one per chunk of pairs, after ``_count_kernel`` counted them.
     None with pair tiles (MoEKernelConfig.pair_tiles): the Gluon GEMMs (moe_sm90_ws) then take every
     (token, k) pair as a one-row tile, its expert read from topk_ids.
  2. ``_moe_gemm_kernel`` GEMM1: gathers token rows of x, decodes w13 in registers, SiLU(gate) * up (or the
     weights' other activation, bias added: sm90_common.Epilogue).
  3. ``_moe_gemm_kernel`` GEMM2: decodes w2, multiplies by the top-k weight (bias added first), writes one row per
     (token, k) pair into a float32 buffer (or one in x's dtype, per config).
  4. ``_combine_kernel`` sums each token's pairs in a fixed order: deterministic, no atomics on data.
Routing (routing_kernels) and the combine (combine) are modules of their own: the Blackwell host launches them too.
vLLM's batched format (``fused_moe_batched_sm90``) runs the same two GEMMs on a plan built from per-expert counts
(``route_batched``): each row of x [E, max_tokens, H] is a pair of its own, GEMM2 writes the batched output, no combine.
Each GEMM tile takes whole K in one program, so a row's sums never depend on where its tile runs.

The GEMMs compute out^T = W @ A^T ("swap AB"): the decoded weights are the MMA's large side and the
token tile (16..128 rows) its small side, so decode-sized batches do not pad the tensor core with
zeros.  Weights arrive in layouts.FragmentLayout, where each thread's bytes are exactly its wgmma A
registers: two 16-byte loads per 128-wide K chunk, decoded in registers with no shuffle.  A code decodes
to bf16 bits of value * 2^-126 (fp16: value * 2^-14) and the block scale byte to a biased bf16 (fp16)
scale; their product is the exact dequantized weight times a power of two, undone in the fp32 epilogue
together with the global scales (gate and up separately).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..configs import LayerShape, MoEKernelConfig, device_traits, select_config
from ..dispatch import sm_count
from ..expert_activation import SILU, ExpertActivation
from ..layouts import rows_16_aligned
from . import sm90_common
from .combine import _combine_kernel, combine
from .moe_sm90_ws import launch_gemm_ws
from .routing_kernels import (
    ROUTE_ONE_PROGRAM,
    _batched_route_kernel,
    _count_kernel,
    _route_kernel,
    route,
    route_batched,
    route_chunks,
    routing_variants_from,
)
from .sm90_common import (
    _TL_DTYPES,
    BF16_EPILOGUE_FIX,
    BLOCK_BYTES,
    FP16_EPILOGUE_FIX,
    SCALE_BLOCK_BYTES,
    Epilogue,
    GemmRouting,
    GemmWeights,
    _activation,
    _after_previous_kernel,
    _decode_words,
    _grouped_tile,
    plain_launches,
)

# what other modules import from here (routing and the combine moved to modules of their own)
__all__ = [
    "ROUTE_ONE_PROGRAM",
    "combine",
    "compiled_variants",
    "batched_config",
    "fused_moe_batched_sm90",
    "fused_moe_sm90",
    "plain_launches",
    "route",
    "route_chunks",
    "routing_variants_from",
]


@triton.jit
def _lanes_portable(r, scale, DTYPE: tl.constexpr):
    """Plain-Triton twin of the PTX: a bf16x2-pattern word -> its two values times the scale (float32)."""
    out = []
    for lane in tl.static_range(2):
        bits = ((r >> (16 * lane)) & 0xFFFF).to(tl.uint16)
        if DTYPE == tl.float16:
            bits = (bits & 0x8000) | ((bits << 3) & 0x0E00)
        out.append((bits.to(DTYPE, bitcast=True).to(tl.float32) * scale).to(DTYPE))
    return tl.join(out[0], out[1])


@triton.jit
def _scales_portable(s, DTYPE: tl.constexpr):
    """Scale bytes -> float32 values of the decoded DTYPE scale (the PTX's prmt + mad)."""
    s = s.to(tl.uint32)
    if DTYPE == tl.bfloat16:
        return ((s << 4) + 0x7000).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return ((s << 7) + 0x1400).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_portable(p, s, SLOTS: tl.constexpr, DTYPE: tl.constexpr):
    """The same bit manipulation as _DECODE_WORD in plain Triton (the interpreter has no inline PTX)."""
    b02, b13 = tl.split(tl.reshape(p, [SLOTS, 8, 2, 2]).to(tl.uint32))
    b0, b2 = tl.split(b02)
    b1, b3 = tl.split(b13)
    w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    pattern = 0x81C081C0
    s_lo, s_hi = tl.split(_scales_portable(tl.reshape(s, [SLOTS, 8, 2]), DTYPE))
    r0 = _lanes_portable(w & pattern, s_lo, DTYPE)
    r1 = _lanes_portable((w << 3) & pattern, s_lo, DTYPE)
    r2 = _lanes_portable(((w & 0x40074007) * 66) & pattern, s_hi, DTYPE)
    r3 = _lanes_portable((((w >> 3) & 0x05C005C0) * 33) & pattern, s_hi, DTYPE)
    lo = tl.reshape(tl.permute(tl.join(r0, r1), (0, 1, 3, 2)), [SLOTS, 32])
    hi = tl.reshape(tl.permute(tl.join(r2, r3), (0, 1, 3, 2)), [SLOTS, 32])
    return lo, hi


@triton.jit
def _decode_fragments(p, s, ROWS: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """FragmentLayout slots -> the [ROWS, 128] weight tile in natural (row, k) order, DTYPE, each value
    code * block_scale / EPILOGUE_FIX exactly.  p: uint8 [2 ROWS, 32]; s: uint8 [2 ROWS, 16] (per slot)."""
    SLOTS: tl.constexpr = 2 * ROWS
    if USE_ASM:
        lo, hi = _decode_words(
            p, tl.reshape(tl.broadcast_to(tl.reshape(s, [SLOTS, 4, 1, 4]), [SLOTS, 4, 2, 4]), [SLOTS, 32]), DTYPE
        )
    else:
        lo, hi = _decode_portable(p, s, SLOTS, DTYPE)
    # lo/hi [slot, g, kh, kp] with slot = 32 warp + 4 r + q: rows 16 warp + r (lo) and + 8 (hi),
    # k = 16 g + 8 kh + 2 q + kp.  Pure relabelling: these are the wgmma A registers already.
    shape: tl.constexpr = [ROWS // 16, 8, 4, 8, 2, 2]
    w = tl.join(tl.reshape(lo, shape), tl.reshape(hi, shape))  # [warp, r, q, g, kh, kp, rh]
    return tl.reshape(tl.permute(w, (0, 6, 1, 3, 4, 2, 5)), [ROWS, 128])


@triton.jit
def _dot_chunk(
    acc, w_slots, s_pairs, slot_ok, pair_ok, chunk, a, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr
):
    """acc += W[tile rows, chunk] @ A^T for one 128-wide K chunk (FragmentLayout addresses)."""
    p = tl.load(w_slots[:, None] + chunk * BLOCK_BYTES + tl.arange(0, 32)[None, :], mask=slot_ok[:, None], other=0)
    s = tl.load(
        s_pairs[:, None] + chunk * SCALE_BLOCK_BYTES + tl.arange(0, 16)[None, :], mask=pair_ok[:, None], other=0
    )
    # four threads (q) share each row pair's scales
    s = tl.reshape(
        tl.broadcast_to(tl.reshape(s, [BLOCK_N // 16, 8, 1, 16]), [BLOCK_N // 16, 8, 4, 16]), [2 * BLOCK_N, 16]
    )
    return tl.dot(_decode_fragments(p, s, BLOCK_N, DTYPE, USE_ASM), a, acc)


@triton.jit
def _load_a(a_base, k0, k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """A^T for K columns k0 .. k0 + BLOCK_K: [BLOCK_K, BLOCK_M] (a_base: the tile's rows, [1, BLOCK_M])."""
    kk = k0 + tl.arange(0, BLOCK_K)
    ptrs = a_base + kk[:, None]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kk < k)[:, None], other=0.0)


@triton.jit
def _tile_sums_and_store(
    args,
    tile,
    weights,
    epilogue,
    TOP_K: tl.constexpr,
    IS_GEMM1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """One tile's K steps and its epilogue (sm90_common.Epilogue), with the token side WIDTH rows wide (the tile's
    first WIDTH rows: all it has where WIDTH < BLOCK_M)."""
    GATE_UP: tl.constexpr = epilogue[5]  # GEMM1 with up rows (sm90_common.Epilogue)
    a_ptr, stride_a, gs_ptr, out_ptr, stride_out, sorted_pairs_ptr, topk_weights_ptr, n_out, k = args
    n_tile, expert, row0, row_end, chunks = tile
    w_slots, s_pairs, slot_ok, pair_ok, n_units, unit_bytes, unit_scale_bytes = weights
    rows = row0 + tl.arange(0, WIDTH)
    row_ok = rows < row_end
    pair_id = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
    if IS_GEMM1:
        a_rows = pair_id // TOP_K
    else:
        a_rows = tl.where(row_ok, rows, row0)
    a_base = a_ptr + a_rows.to(tl.int64)[None, :] * stride_a
    acc = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)  # GATE_UP only (unused otherwise)
    w_up = w_slots + n_units * unit_bytes  # GATE_UP: the up rows, n_units units after the gate rows
    s_up = s_pairs + n_units * unit_scale_bytes
    for chunk in tl.range(0, chunks, num_stages=NUM_STAGES):
        a = _load_a(a_base, chunk * BLOCK_K, k, BLOCK_K, EVEN_K)
        acc = _dot_chunk(acc, w_slots, s_pairs, slot_ok, pair_ok, chunk, a, BLOCK_N, DTYPE, USE_ASM)
        if GATE_UP:
            acc_up = _dot_chunk(acc_up, w_up, s_up, slot_ok, pair_ok, chunk, a, BLOCK_N, DTYPE, USE_ASM)

    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    store_mask = (offs_n < n_out)[:, None] & row_ok[None, :]
    fix = BF16_EPILOGUE_FIX if DTYPE == tl.bfloat16 else FP16_EPILOGUE_FIX
    bias_ptr = epilogue[0]
    if bias_ptr is not None:  # one [E, (2 if GATE_UP) n_out] float32 row per expert
        bias_row = bias_ptr + expert.to(tl.int64) * (2 * n_out if GATE_UP else n_out) + offs_n
        n_ok = offs_n < n_out
    if GATE_UP:
        gate = acc * (tl.load(gs_ptr + expert * 2) * fix)
        up = acc_up * (tl.load(gs_ptr + expert * 2 + 1) * fix)
        if bias_ptr is not None:
            gate += tl.load(bias_row, mask=n_ok, other=0.0)[:, None]
            up += tl.load(bias_row + n_out, mask=n_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
        tl.store(out_ptrs, _activation(gate, up, epilogue, USE_ASM).to(DTYPE), mask=store_mask)
    elif IS_GEMM1:  # GEMM1 without up rows
        h = acc * (tl.load(gs_ptr + expert) * fix)
        if bias_ptr is not None:
            h += tl.load(bias_row, mask=n_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
        tl.store(out_ptrs, _activation(h, h, epilogue, USE_ASM).to(DTYPE), mask=store_mask)
    else:
        if bias_ptr is not None:
            y = acc * (tl.load(gs_ptr + expert) * fix) + tl.load(bias_row, mask=n_ok, other=0.0)[:, None]
            if epilogue[4]:
                y = y * tl.load(topk_weights_ptr + pair_id, mask=row_ok, other=0.0)[None, :]
        elif epilogue[4]:
            weight = tl.load(topk_weights_ptr + pair_id, mask=row_ok, other=0.0)
            y = acc * (tl.load(gs_ptr + expert) * fix * weight)[None, :]
        else:
            y = acc * (tl.load(gs_ptr + expert) * fix)
        out_ptrs = out_ptr + pair_id.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
        tl.store(out_ptrs, y, mask=store_mask)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    stride_a,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    stride_out,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_row_end_ptr,
    num_tiles_ptr,
    topk_weights_ptr,
    n_out,
    k,
    kp,
    epilogue,
    TOP_K: tl.constexpr,
    IS_GEMM1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    NARROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """Persistent grouped GEMM over all experts: out^T[n, m] = sum_k W_e[n, k] A[m, k], whole tiles dealt out to
    the programs in turn (whole K each).

    The tile map comes from _route_kernel's buffers.

    IS_GEMM1 (GEMM1): A rows are gathered from x by pair // TOP_K; W has 2 * n_out rows (gate, then up), or n_out
    with a non-gated activation; the epilogue writes act(gs_g * gate + b_g, gs_u * up + b_u) to out[row, n] in
    sorted-row order (``epilogue``: sm90_common.Epilogue, the activation SiLU(gate) * up by default).
    Otherwise (GEMM2): A rows are the sorted rows; the epilogue writes topk_weight * (gs * acc + b) (no weight
    where Epilogue.ROUTER_WEIGHT is False) to out[pair, n] (float32, or the buffer's dtype).
    NARROW (GemmConfig.narrow_tiles): a tile whose rows fit in BLOCK_M / 2 (NARROW >= 1) or BLOCK_M / 4
    (NARROW 2) runs its loads and MMAs that narrow, so an expert's last tile of a few rows does not pay for
    BLOCK_M tokens of MMA.
    """
    _after_previous_kernel(PDL)
    pid = tl.program_id(0)
    num_m_tiles = tl.load(num_tiles_ptr)
    num_n_tiles = tl.cdiv(n_out, BLOCK_N)
    chunks = kp // BLOCK_K
    n_units = tl.cdiv(n_out, 64)  # 64-row units of FragmentLayout (gate and up padded apart)
    unit_bytes = chunks * BLOCK_BYTES
    unit_scale_bytes = chunks * SCALE_BLOCK_BYTES
    UNITS: tl.constexpr = BLOCK_N // 64
    slot = tl.arange(0, 2 * BLOCK_N)
    pair = tl.arange(0, BLOCK_N // 2)
    args = (a_ptr, stride_a, gs_ptr, out_ptr, stride_out, sorted_pairs_ptr, topk_weights_ptr, n_out, k)
    GATE_UP: tl.constexpr = epilogue[5]
    for mn in range(pid, num_m_tiles * num_n_tiles, tl.num_programs(0)):
        m_tile, n_tile = _grouped_tile(mn, num_m_tiles, num_n_tiles)

        expert = tl.load(tile_expert_ptr + m_tile)
        row0 = tl.load(tile_row_ptr + m_tile)
        row_end = tl.load(tile_row_end_ptr + m_tile)
        matrices = 2 * n_units if GATE_UP else n_units  # units per expert
        slot_unit = n_tile * UNITS + slot // 128
        pair_unit = n_tile * UNITS + pair // 32
        slot_ok = slot_unit < n_units
        pair_ok = pair_unit < n_units
        unit0 = expert.to(tl.int64) * matrices
        w_slots = w_ptr + (unit0 + slot_unit) * unit_bytes + (slot % 128) * 32
        s_pairs = s_ptr + (unit0 + pair_unit) * unit_scale_bytes + (pair % 32) * 16
        tile = (n_tile, expert, row0, row_end, chunks)
        weights = (w_slots, s_pairs, slot_ok, pair_ok, n_units, unit_bytes, unit_scale_bytes)
        # a constexpr False left of `and` makes the `if` static: widths NARROW does not allow are never built
        if NARROW >= 2 and row_end - row0 <= BLOCK_M // 4:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                epilogue,
                TOP_K,
                IS_GEMM1,
                BLOCK_N,
                BLOCK_M // 4,
                BLOCK_K,
                EVEN_K,
                DTYPE,
                NUM_STAGES,
                USE_ASM,
            )
        elif NARROW >= 1 and row_end - row0 <= BLOCK_M // 2:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                epilogue,
                TOP_K,
                IS_GEMM1,
                BLOCK_N,
                BLOCK_M // 2,
                BLOCK_K,
                EVEN_K,
                DTYPE,
                NUM_STAGES,
                USE_ASM,
            )
        else:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                epilogue,
                TOP_K,
                IS_GEMM1,
                BLOCK_N,
                BLOCK_M,
                BLOCK_K,
                EVEN_K,
                DTYPE,
                NUM_STAGES,
                USE_ASM,
            )


def compiled_variants() -> int:
    """How many kernel variants Triton has compiled in this process (all kernels here, all devices)."""
    kernels = (_count_kernel, _route_kernel, _batched_route_kernel, _moe_gemm_kernel, _combine_kernel)
    # device_caches: device -> (kernel cache, ...) in Triton 3.x; the interpreter has none.
    return sum(len(caches[0]) for k in kernels for caches in getattr(k, "device_caches", {}).values())


def _gluon_rows_ok(x: torch.Tensor, intermediate: int) -> bool:
    """Whether the warp-specialized Gluon GEMMs can run: sm_90 code whose cp.async row copies are 16 bytes,
    compiled only where the JIT marks the row pointers and strides 16-divisible.  The interpreter (CPU tensors)
    and other rows run the Triton kernel with the same tiles, which computes the same sums."""
    return x.is_cuda and rows_16_aligned(x) and intermediate % 16 == 0


def launch_gemm(
    a: torch.Tensor,
    weights: GemmWeights,
    out: torch.Tensor,
    routing: GemmRouting,
    config: MoEKernelConfig,
    epilogue: Epilogue,
    *,
    is_gemm1: bool,
    top_k: int,
    sms: int,
) -> None:
    """One launch of _moe_gemm_kernel: GEMM1 when ``is_gemm1`` (config.gemm1's tiles), out[row] = act(a[pair // top_k]
    @ W^T) for the pair of each sorted row; otherwise GEMM2 (config.gemm2's), out[pair] = routing weight *
    (a[row] @ W^T).  a [rows, K], out [rows, N]; ``sms`` programs per GemmConfig.programs_per_sm.  The routing
    kernel's tile map is read (``routing.pair_tiles`` is the Gluon GEMMs' alone)."""
    gemm = config.gemm1 if is_gemm1 else config.gemm2
    k, kp = a.shape[1], weights.packed.shape[-1] * 2
    topk_weights = routing.topk_weights if is_gemm1 else routing.topk_weights.reshape(-1)  # GEMM1 reads none
    _moe_gemm_kernel[(sms * gemm.programs_per_sm,)](
        a,
        a.stride(0),
        weights.packed,
        weights.scale,
        weights.global_scale,
        out,
        out.stride(0),
        *routing.tile_map,
        topk_weights,
        out.shape[1],
        k,
        kp,
        epilogue,
        TOP_K=top_k,
        IS_GEMM1=is_gemm1,
        BLOCK_N=gemm.block_n,
        BLOCK_M=config.block_m,
        BLOCK_K=128,
        EVEN_K=k == kp,
        DTYPE=_TL_DTYPES[a.dtype],
        NUM_STAGES=gemm.num_stages,
        USE_ASM=a.is_cuda,  # the interpreter has no PTX
        NARROW=gemm.narrow_tiles,
        **sm90_common._dependent_launch(a.device),
        **gemm.launch_options(),
    )


def _map_len(expert_map: torch.Tensor | None) -> int:
    return 0 if expert_map is None else expert_map.numel()


def _gemm_routing(
    config: MoEKernelConfig,
    both_gluon: bool,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_experts: int,
) -> GemmRouting:
    """What both GEMMs read of the routing: the routing kernels' tile map, or with pair tiles none."""
    # pair tiles: the Gluon GEMMs take each pair's expert from topk_ids (and the expert map), and both GEMMs must
    # number rows alike
    pair_tiles = config.pair_tiles and both_gluon
    if pair_tiles:
        # no routing launch; the tile-map arguments go unread: a 16-byte aligned stand-in (as route()'s buffers
        # are), so which variant compiles never depends on topk_ids' alignment
        tile_map = (torch.empty(4, dtype=torch.int32, device=topk_ids.device),) * 5
    else:
        sorted_pairs, _, _, *tiles = route(topk_ids, num_experts, config.block_m, expert_map)
        tile_map = (sorted_pairs, *tiles)  # the GEMMs read each tile's expert and rows, not the per-expert runs
    return GemmRouting(tile_map, topk_ids.reshape(-1), topk_weights, expert_map, pair_tiles)


def fused_moe_sm90(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    intermediate: int,
    config: MoEKernelConfig | None = None,
    out: torch.Tensor | None = None,
    *,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Host wrapper: shapes are checked by the caller (api.fused_moe); launches the four kernels, three with
    pair tiles (MoEKernelConfig.pair_tiles, both GEMMs warp-specialized): no routing.  Pairs routed nowhere
    (routing.routed_pairs: ids or expert-map entries out of range) contribute nothing on every path.

    ``config``: configs.select_config's for this call's shape where None (tests and the tuner pass their own).
    The variant (weights.MoEWeights' activation and biases, the router weight on the input) reaches the GEMMs as
    sm90_common.Epilogue; with ``apply_router_weight_on_input`` GEMM1 reads each pair's row x[t] * w[t, j]
    (rounded to x's dtype, one elementwise pass) instead of x[t], and GEMM2 weights nothing."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13_packed.shape[0]
    out = torch.empty_like(x) if out is None else out
    if t == 0:
        return out
    if config is None:
        shape = LayerShape(num_experts, top_k, hidden, intermediate, x.dtype, _map_len(expert_map), activation.gated)
        config = select_config(t, shape, device_traits(x.device))
    gather = 1 if apply_router_weight_on_input else top_k  # GEMM1's A row of pair p: p // gather
    if apply_router_weight_on_input:  # one row per pair, as vLLM rounds it: a1 * topk_weights.to(a1.dtype)
        x = (x[:, None, :] * topk_weights.to(x.dtype)[:, :, None]).reshape(t * top_k, hidden)
    epilogue1 = Epilogue.of(w13_bias, activation, False)
    epilogue2 = Epilogue.of(w2_bias, None, not apply_router_weight_on_input)
    ws_ok = _gluon_rows_ok(x, intermediate)
    if x.is_cuda and not ws_ok and config.block_m < 16:
        # 8-token tiles are valid only where both GEMMs are Gluon (MoEKernelConfig.is_valid): the Triton GEMM takes
        # them as mma.sync tiles, and rows it had to take in their place gave 0.95 relative error on an H200 (x a
        # column slice of a wider buffer, 2026-11-28; the API copies such rows, so only direct callers get here)
        config = config.with_token_tile(16)
    ws1, ws2 = config.gemm1.warp_specialized and ws_ok, config.gemm2.warp_specialized and ws_ok
    routing = _gemm_routing(config, ws1 and ws2, topk_weights, topk_ids, expert_map, num_experts)
    sms = sm_count(x.device, off_gpu=2)  # the interpreter: two programs, so the persistent loop still strides
    act = torch.empty(t * top_k, intermediate, dtype=x.dtype, device=x.device)  # the activation
    launch1 = launch_gemm_ws if ws1 else launch_gemm
    launch1(
        x,
        GemmWeights(w13_packed, w13_scale, w13_global),
        act,
        routing,
        config,
        epilogue1,
        is_gemm1=True,
        top_k=gather,
        sms=sms,
    )
    partial_dtype = x.dtype if config.partials_in_x_dtype else torch.float32  # the store casts the fp32 rows
    partial = torch.empty(t * top_k, hidden, dtype=partial_dtype, device=x.device)
    launch2 = launch_gemm_ws if ws2 else launch_gemm
    launch2(
        act,
        GemmWeights(w2_packed, w2_scale, w2_global),
        partial,
        routing,
        config,
        epilogue2,
        is_gemm1=False,
        top_k=top_k,
        sms=sms,
    )
    combine(partial, topk_ids, expert_map, num_experts, out)
    return out


def batched_config(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, gated: bool, expected_rows: float, device
) -> MoEKernelConfig:
    """The config of a batched forward whose busy experts hold about ``expected_rows`` rows each: the one
    select_config gives the same experts at the token count where a top-1 routing over them puts that many rows on
    each busy expert (LayerShape.tokens_up_to_rows), without pair tiles (each tile's expert comes from the counts,
    not from topk_ids)."""
    shape = LayerShape(num_experts, 1, hidden, intermediate, dtype, 0, gated)
    config = select_config(shape.tokens_up_to_rows(max(expected_rows, 1.0)), shape, device_traits(device))
    return dataclasses.replace(config, pair_tiles=False)


def fused_moe_batched_sm90(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    intermediate: int,
    out: torch.Tensor,
    config: MoEKernelConfig,
    *,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> None:
    """Host wrapper of the batched format (inputs checked by api.fused_moe_batched): x [E, M, H] with unit stride
    along H and rows M apart, expert_num_tokens int32 [E]; writes out[e, r] = FFN_e(x[e, r]) for r < count_e (the
    count clamped to [0, M]), unweighted, and nothing else.  Three launches: route_batched, then GEMM1 and GEMM2
    reading its tile map (each row its own pair, top-k 1; no combine: GEMM2's rows are the output).  No host
    synchronisation; every grid and buffer is sized from E, M, H and I."""
    e, m, hidden = x.shape
    if e * m == 0:
        return
    x_rows, out_rows = x.view(e * m, hidden), out.view(e * m, hidden)
    ws_ok = _gluon_rows_ok(x_rows, intermediate) and rows_16_aligned(out_rows)
    if x.is_cuda and not ws_ok and config.block_m < 16:  # 8-token tiles need both GEMMs Gluon (fused_moe_sm90)
        config = config.with_token_tile(16)
    sorted_rows, _, _, *tiles = route_batched(expert_num_tokens, m, config.block_m)
    # GEMM2 weights nothing and no tile is a pair tile: the ids and weights go unread (16-byte aligned stand-ins)
    stand_in = torch.empty(4, dtype=torch.int32, device=x.device)
    routing = GemmRouting((sorted_rows, *tiles), stand_in, stand_in.view(torch.float32), None, False)
    sms = sm_count(x.device, off_gpu=2)
    act = torch.empty(e * m, intermediate, dtype=x.dtype, device=x.device)
    epilogue1 = Epilogue.of(w13_bias, activation, False)
    epilogue2 = Epilogue.of(w2_bias, None, False)
    launch1 = launch_gemm_ws if config.gemm1.warp_specialized and ws_ok else launch_gemm
    launch1(
        x_rows,
        GemmWeights(w13_packed, w13_scale, w13_global),
        act,
        routing,
        config,
        epilogue1,
        is_gemm1=True,
        top_k=1,
        sms=sms,
    )
    launch2 = launch_gemm_ws if config.gemm2.warp_specialized and ws_ok else launch_gemm
    launch2(
        act,
        GemmWeights(w2_packed, w2_scale, w2_global),
        out_rows,
        routing,
        config,
        epilogue2,
        is_gemm1=False,
        top_k=1,
        sms=sms,
    )
