"""The sm_90 MoE's grouped GEMM in Triton (``_moe_gemm_kernel``) and its launch (``launch_gemm``), one kernel for
GEMM1 and GEMM2 over all experts; the host (``host.fused_moe_sm90``) chooses it or the Gluon one (gemm_gluon) per
GEMM.

The GEMMs compute out^T = W @ A^T ("swap AB"): the decoded weights are the MMA's large side and the
token tile (16..128 rows) its small side, so decode-sized batches do not pad the tensor core with
zeros.  Weights arrive in layouts.FragmentLayout, where each thread's bytes are exactly its wgmma A
registers: two 16-byte loads per 128-wide K chunk, decoded in registers with no shuffle.  A code decodes
to bf16 bits of value * 2^-126 (fp16: value * 2^-14) and the block scale byte to a biased bf16 (fp16)
scale; their product is the exact dequantized weight times a power of two, undone in the fp32 epilogue
together with the global scales (gate and up separately).  Each GEMM tile takes whole K in one program, so a
row's sums never depend on where its tile runs.  GEMM1 gathers its token rows (pair // top_k) through addresses;
GEMM2, whose rows are the tile's sorted rows, takes them and the weight blocks as TMA boxes (``_boxes``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton import common as triton_common
from ..triton.common import _TL_DTYPES, _after_previous_kernel
from ..triton.launcher import launch
from .common import (
    BF16_EPILOGUE_FIX,
    BLOCK_BYTES,
    FP16_EPILOGUE_FIX,
    SCALE_BLOCK_BYTES,
    Epilogue,
    GemmRouting,
    GemmWeights,
    _activation,
    _decode_words,
    _grouped_tile,
    fragment_views,
)
from .configs import MoEKernelConfig

__all__ = ["launch_gemm"]


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
def _decoded_dot(acc, p, s, a, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """acc += W @ A^T for one 128-wide K chunk of the weight tile, p its value slots [2 BLOCK_N, 32] and s its scale
    pairs [BLOCK_N / 2, 16] (FragmentLayout bytes)."""
    # four threads (q) share each row pair's scales
    s = tl.reshape(
        tl.broadcast_to(tl.reshape(s, [BLOCK_N // 16, 8, 1, 16]), [BLOCK_N // 16, 8, 4, 16]), [2 * BLOCK_N, 16]
    )
    return tl.dot(_decode_fragments(p, s, BLOCK_N, DTYPE, USE_ASM), a, acc)


@triton.jit
def _dot_chunk(
    acc, w_slots, s_pairs, slot_ok, pair_ok, chunk, a, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr
):
    """_decoded_dot of one K chunk loaded through FragmentLayout addresses."""
    p = tl.load(w_slots[:, None] + chunk * BLOCK_BYTES + tl.arange(0, 32)[None, :], mask=slot_ok[:, None], other=0)
    s = tl.load(
        s_pairs[:, None] + chunk * SCALE_BLOCK_BYTES + tl.arange(0, 16)[None, :], mask=pair_ok[:, None], other=0
    )
    return _decoded_dot(acc, p, s, a, BLOCK_N, DTYPE, USE_ASM)


@triton.jit
def _dot_chunk_tma(
    acc, w_desc, s_desc, unit, chunk, a, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr
):
    """_decoded_dot of one K chunk loaded as TMA boxes (common.fragment_views; ``unit`` the tile's first 64-row unit):
    the same bytes in the same slots."""
    p = tl.reshape(w_desc.load([chunk, unit, 0, 0]), [2 * BLOCK_N, 32])
    s = tl.reshape(s_desc.load([chunk, unit, 0, 0]), [BLOCK_N // 2, 16])
    return _decoded_dot(acc, p, s, a, BLOCK_N, DTYPE, USE_ASM)


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
    boxes,
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
    TMA: tl.constexpr,
):
    """One tile's K steps and its epilogue (common.Epilogue), with the token side WIDTH rows wide (the tile's
    first WIDTH rows: all it has where WIDTH < BLOCK_M); with TMA (GEMM2) its token rows ([WIDTH, 128] boxes) and
    weights arrive as boxes (``boxes``), else through address tensors (``args``, ``weights``)."""
    GATE_UP: tl.constexpr = epilogue[4]  # GEMM1 with up rows (common.Epilogue)
    a_ptr, stride_a, gs_ptr, out_ptr, stride_out, sorted_pairs_ptr, n_out, k = args
    n_tile, expert, row0, row_end, chunks = tile
    w_slots, s_pairs, slot_ok, pair_ok, n_units, unit_bytes, unit_scale_bytes = weights
    a_desc, w_desc, s_desc, unit = boxes  # TMA only
    rows = row0 + tl.arange(0, WIDTH)
    row_ok = rows < row_end
    pair_id = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
    acc = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)  # GATE_UP only (unused otherwise)
    if TMA:  # GEMM2: the tile's sorted rows are one box of a (rows past the tile's are never stored)
        for chunk in tl.range(0, chunks, num_stages=NUM_STAGES):
            a = a_desc.load([row0, chunk * BLOCK_K]).T
            acc = _dot_chunk_tma(acc, w_desc, s_desc, unit, chunk, a, BLOCK_N, DTYPE, USE_ASM)
    else:
        if IS_GEMM1:
            a_rows = pair_id // TOP_K
        else:
            a_rows = tl.where(row_ok, rows, row0)
        a_base = a_ptr + a_rows.to(tl.int64)[None, :] * stride_a
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
        y = acc * (tl.load(gs_ptr + expert) * fix)
        if bias_ptr is not None:
            y += tl.load(bias_row, mask=n_ok, other=0.0)[:, None]
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
    n_out,
    k,
    kp,
    a_desc,
    a_desc_half,
    a_desc_quarter,
    w_desc,
    s_desc,
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
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """Persistent grouped GEMM over all experts: out^T[n, m] = sum_k W_e[n, k] A[m, k], whole tiles dealt out to
    the programs in turn (whole K each).

    The tile map comes from _route_kernel's buffers.

    IS_GEMM1 (GEMM1): A rows are gathered from x by pair // TOP_K; W has 2 * n_out rows (gate, then up), or n_out
    with a non-gated activation; the epilogue writes act(gs_g * gate + b_g, gs_u * up + b_u) to out[row, n] in
    sorted-row order (``epilogue``: common.Epilogue, the activation SiLU(gate) * up by default).
    Otherwise (GEMM2): A rows are the sorted rows; the epilogue writes gs * acc + b to out[pair, n] (float32, or
    the buffer's dtype; the combine applies the router weights).
    NARROW (GemmConfig.narrow_tiles): a tile whose rows fit in BLOCK_M / 2 (NARROW >= 1) or BLOCK_M / 4
    (NARROW 2) runs its loads and MMAs that narrow, so an expert's last tile of a few rows does not pay for
    BLOCK_M tokens of MMA.
    TMA (GEMM2): a's tile rows and the weights' values and scales arrive as TMA boxes instead of through address
    tensors (a_desc, a_desc_half, a_desc_quarter: BLOCK_M, BLOCK_M / 2 and BLOCK_M / 4 rows, None for a width NARROW
    does not run, separate arguments because Triton 3.6's launcher does not expand descriptors inside a tuple;
    w_desc, s_desc: common.fragment_views).  The address tensors held the registers: a 128 x 128 tile compiles to
    142 registers instead of 208, and capped at 128 (two programs an SM, each one's fill and epilogue under the
    other's MMAs) spills nothing where the address tensors spilled 124 bytes (design 002 decision 25).
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
    args = (a_ptr, stride_a, gs_ptr, out_ptr, stride_out, sorted_pairs_ptr, n_out, k)
    GATE_UP: tl.constexpr = epilogue[4]
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
        unit = expert * matrices + n_tile * UNITS
        # a constexpr False left of `and` makes the `if` static: widths NARROW does not allow are never built
        if NARROW >= 2 and row_end - row0 <= BLOCK_M // 4:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                (a_desc_quarter, w_desc, s_desc, unit),
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
                TMA,
            )
        elif NARROW >= 1 and row_end - row0 <= BLOCK_M // 2:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                (a_desc_half, w_desc, s_desc, unit),
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
                TMA,
            )
        else:
            _tile_sums_and_store(
                args,
                tile,
                weights,
                (a_desc, w_desc, s_desc, unit),
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
                TMA,
            )


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
    @ W^T) for the pair of each sorted row; otherwise GEMM2 (config.gemm2's), out[pair] = a[row] @ W^T (unweighted).
    a [rows, K], out [rows, N]; ``sms`` programs per GemmConfig.programs_per_sm.  The routing
    kernel's tile map is read (``routing.pair_tiles`` is the Gluon GEMMs' alone)."""
    gemm = config.gemm1 if is_gemm1 else config.gemm2
    k, kp = a.shape[1], weights.packed.shape[-1] * 2
    # a descriptor needs some rows, a 16-byte aligned base and row stride (the weights' blocks always are)
    rows_ok = a.shape[0] > 0 and a.data_ptr() % 16 == 0 and a.stride(0) * a.element_size() % 16 == 0
    tma = not is_gemm1 and rows_ok
    widths = gemm.narrow_tiles + 1  # the token widths the tiles run: block_m, block_m / 2, block_m / 4
    boxes = _boxes(a, weights, kp, config.block_m, gemm.block_n, widths) if tma else (None,) * 5
    launch(
        _moe_gemm_kernel,
        (sms * gemm.programs_per_sm,),
        a,
        a.stride(0),
        weights.packed,
        weights.scale,
        weights.global_scale,
        out,
        out.stride(0),
        *routing.tile_map,
        out.shape[1],
        k,
        kp,
        *boxes,
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
        TMA=tma,
        **triton_common._dependent_launch(a.device),
        **gemm.launch_options(),
    )


def _boxes(a: torch.Tensor, weights: GemmWeights, kp: int, block_m: int, block_n: int, widths: int) -> tuple:
    """GEMM2's TMA descriptors: a tile's token rows [block_m >> j, 128] of ``a`` for each of the ``widths`` widths its
    tiles run (zeros past its K and its rows; None for the widths it does not), and one K chunk of the tile's
    block_n / 64 units of values and scales (common.fragment_views)."""
    values, scales = fragment_views(weights.packed, weights.scale, kp)
    units = block_n // 64
    rows = [
        TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m >> j, 128]) if j < widths else None
        for j in range(3)
    ]
    return (*rows, *(TensorDescriptor(v.flat, v.shape, v.strides, [1, units, v.rows, 128]) for v in (values, scales)))
