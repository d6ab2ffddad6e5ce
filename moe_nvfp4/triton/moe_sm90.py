"""Fused NVFP4 MoE for Hopper (sm_90) in Triton: routing, two persistent grouped GEMMs, a fixed-order combine.

Launches per forward (each grid sized from the SM count or T, never from routing data):
  1. ``_route_kernel``   one program: per-expert counts/offsets, pairs grouped by expert, the tile map.
  2. ``_moe_gemm_kernel`` GEMM1: gathers token rows of x, decodes w13 in registers, SiLU(gate) * up.
  3. ``_moe_gemm_kernel`` GEMM2: decodes w2, multiplies by the top-k weight, writes one row per
     (token, k) pair (and per K split) into a float32 buffer.
  4. ``_combine_kernel`` sums each token's pairs in a fixed order: deterministic, no atomics on data.

The GEMMs compute out^T = W @ A^T ("swap AB"): the decoded weights are the MMA's large side and the
token tile (16..128 rows) its small side, so decode-sized batches do not pad the tensor core with
zeros.  An FP4 code decodes exactly to fp16 bits (value * 2^-14) and the e4m3 scale to fp16 bits
(value * 2^-8); their product, scaled by 2^22 in fp32, is the exact dequantized weight, rounded to
the activation dtype without loss (at most 6 significant bits).  Global scales apply in fp32 in the
epilogue, separately for gate and up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import MoEKernelConfig

@triton.jit
def _local_experts(ids_ptr, expert_map_ptr, p0, num_pairs, HAS_MAP: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pairs p0 .. p0+BLOCK_P: their local expert and whether they count (in range, on this rank)."""
    offs = p0 + tl.arange(0, BLOCK_P)
    valid = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=valid, other=0)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + e, mask=valid, other=-1)
    return offs, e, valid & (e >= 0)


@triton.jit
def _route_kernel(
    ids_ptr,
    expert_map_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    offsets_ptr,
    cursor_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    num_pairs,
    num_experts,
    max_tiles,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    E_POW2: tl.constexpr,
):
    experts = tl.arange(0, E_POW2)
    expert_ok = experts < num_experts
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        _, e, valid = _local_experts(ids_ptr, expert_map_ptr, p0, num_pairs, HAS_MAP, BLOCK_P)
        counts += tl.histogram(tl.where(valid, e, 0), E_POW2, mask=valid)
    ends = tl.cumsum(counts, 0)
    starts = ends - counts
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    tl.store(counts_ptr + experts, counts, mask=expert_ok)
    tl.store(offsets_ptr + experts, starts, mask=expert_ok)
    tl.store(offsets_ptr + experts + 1, ends, mask=experts == num_experts - 1)
    tl.store(cursor_ptr + experts, starts, mask=expert_ok)
    tl.store(num_tiles_ptr, tl.sum(tiles, 0))
    tl.debug_barrier()

    # Scatter: the order inside an expert's run may vary between runs, which changes no result (each
    # row's dot products are independent of its neighbours and the combine is by pair index).
    for p0 in range(0, num_pairs, BLOCK_P):
        offs, e, valid = _local_experts(ids_ptr, expert_map_ptr, p0, num_pairs, HAS_MAP, BLOCK_P)
        pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        tl.store(sorted_pairs_ptr + pos, offs, mask=valid)

    # Tile map: expert e owns tiles [tile_ends[e] - tiles[e], tile_ends[e]); tiles past the total are unused.
    first_tile = tile_ends - tiles
    for j in range(0, tl.max(tiles, 0)):
        owned = expert_ok & (j < tiles)
        tl.store(tile_expert_ptr + first_tile + j, experts, mask=owned)
        tl.store(tile_row_ptr + first_tile + j, starts + j * BLOCK_M, mask=owned)
    for t0 in range(tl.sum(tiles, 0), max_tiles, BLOCK_P):
        t = t0 + tl.arange(0, BLOCK_P)
        tl.store(tile_expert_ptr + t, tl.full([BLOCK_P], -1, tl.int32), mask=t < max_tiles)
        tl.store(tile_row_ptr + t, tl.zeros([BLOCK_P], tl.int32), mask=t < max_tiles)


# FP4 -> 16-bit decode, four bytes (eight values) per call: spread the bytes into 16-bit lanes (prmt),
# move the sign to bit 15 and the 3 magnitude bits to the top of the exponent / first mantissa bit, then
# one packed multiply by the (pre-biased) block scale.  Low nibbles are the first half of a chunk, high
# nibbles the second (layouts.ChunkedNibbleLayout).
_ASM_BODY = """{{
.reg .b32 t, u, a, b;
prmt.b32 t, $2, 0, 0x4140;
prmt.b32 u, $2, 0, 0x4342;
shl.b32 a, t, {sign}; and.b32 a, a, 0x80008000;
shl.b32 b, t, {mag}; and.b32 b, b, {mask}; or.b32 a, a, b;
mul.rn.{ty}x2 $0, a, $3;
shl.b32 a, u, {sign}; and.b32 a, a, 0x80008000;
shl.b32 b, u, {mag}; and.b32 b, b, {mask}; or.b32 a, a, b;
mul.rn.{ty}x2 $1, a, $4;
}}"""
_BF16 = dict(mask="0x01C001C0", ty="bf16")
_FP16 = dict(mask="0x0E000E00", ty="f16")
ASM_BF16_LO: tl.constexpr = tl.constexpr(_ASM_BODY.format(sign=12, mag=6, **_BF16))
ASM_BF16_HI: tl.constexpr = tl.constexpr(_ASM_BODY.format(sign=8, mag=2, **_BF16))
ASM_FP16_LO: tl.constexpr = tl.constexpr(_ASM_BODY.format(sign=12, mag=9, **_FP16))
ASM_FP16_HI: tl.constexpr = tl.constexpr(_ASM_BODY.format(sign=8, mag=5, **_FP16))
# A decoded code is value * 2^-126 in bf16 bits and value * 2^-14 in fp16 bits.  Scales are pre-multiplied
# by SCALE_BIAS so that products stay exact (bf16: normal numbers; fp16: exact subnormals), and the
# epilogue multiplies by EPILOGUE_FIX = 2^126 / SCALE_BIAS (bf16) or 2^14 (fp16).
BF16_SCALE_BIAS: tl.constexpr = tl.constexpr(2.0**119)
BF16_EPILOGUE_FIX: tl.constexpr = tl.constexpr(2.0**7)
FP16_EPILOGUE_FIX: tl.constexpr = tl.constexpr(2.0**14)


@triton.jit
def _load_scales(s_ptrs, mask, DTYPE: tl.constexpr):
    """e4m3 bytes -> block scales in DTYPE, pre-biased for the decode (exact)."""
    s = tl.load(s_ptrs, mask=mask, other=0).to(tl.uint16)
    bits = ((s & 0x80) << 8) | ((s & 0x7F) << 7)  # e4m3 -> fp16 bits of value * 2^-8
    scale = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    if DTYPE == tl.bfloat16:
        scale = scale * BF16_SCALE_BIAS
    return scale.to(DTYPE)


@triton.jit
def _decode_fp4(packed, scale, HIGH: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                USE_ASM: tl.constexpr):
    """uint8 [ROWS, COLS] (the chosen nibble of each byte) x scales [ROWS, COLS // 16] -> DTYPE weights,
    each equal to value * block_scale / EPILOGUE_FIX exactly."""
    s = tl.reshape(tl.broadcast_to(scale[:, :, None], [ROWS, COLS // 16, 16]), [ROWS, COLS])
    if USE_ASM:
        if DTYPE == tl.bfloat16:
            asm: tl.constexpr = ASM_BF16_HI if HIGH else ASM_BF16_LO
            return tl.inline_asm_elementwise(asm, "=r,=r,r,r,r", [packed, s], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            asm: tl.constexpr = ASM_FP16_HI if HIGH else ASM_FP16_LO
            return tl.inline_asm_elementwise(asm, "=r,=r,r,r,r", [packed, s], dtype=tl.float16, is_pure=True, pack=4)
    # The same bit manipulation in plain Triton, for the interpreter (no inline PTX there).
    n = ((packed >> 4) if HIGH else (packed & 0xF)).to(tl.uint16)
    if DTYPE == tl.bfloat16:
        bits = ((n & 8) << 12) | ((n & 7) << 6)
    else:
        bits = ((n & 8) << 12) | ((n & 7) << 9)
    return (bits.to(DTYPE, bitcast=True).to(tl.float32) * s.to(tl.float32)).to(DTYPE)


@triton.jit
def _dot_chunk(acc, w_row_ptr, s_row_ptr, k0, a, row_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DTYPE: tl.constexpr, USE_ASM: tl.constexpr, JOIN_HALVES: tl.constexpr):
    """acc += W[rows, k0:k0+BLOCK_K] @ A^T for one chunk in the chunked nibble layout."""
    HALF: tl.constexpr = BLOCK_K // 2
    kb = tl.arange(0, HALF)
    packed = tl.load(w_row_ptr + (k0 // 2 + kb)[None, :], mask=row_mask, other=0)
    sb = tl.arange(0, HALF // 16)
    s_lo = _load_scales(s_row_ptr + (k0 // 16 + sb)[None, :], row_mask, DTYPE)
    s_hi = _load_scales(s_row_ptr + (k0 // 16 + HALF // 16 + sb)[None, :], row_mask, DTYPE)
    w_lo = _decode_fp4(packed, s_lo, False, BLOCK_N, HALF, DTYPE, USE_ASM)
    w_hi = _decode_fp4(packed, s_hi, True, BLOCK_N, HALF, DTYPE, USE_ASM)
    if JOIN_HALVES:  # one K=128 dot: Triton keeps its wgmmas in flight instead of waiting per half
        w = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), [BLOCK_N, BLOCK_K])
        return tl.dot(w, a, acc)
    a_halves = tl.reshape(tl.permute(tl.reshape(a, [2, HALF, a.shape[1]]), (1, 2, 0)), [HALF, a.shape[1], 2])
    a_lo, a_hi = tl.split(a_halves)
    return tl.dot(w_hi, a_hi, tl.dot(w_lo, a_lo, acc))


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    stride_a,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    stride_out,
    stride_split,
    sorted_pairs_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    topk_weights_ptr,
    n_out,
    k,
    kp,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    JOIN_HALVES: tl.constexpr,
):
    """Persistent grouped GEMM over all experts: out^T[n, m] = sum_k W_e[n, k] A[m, k].

    GATED (GEMM1): A rows are gathered from x by pair // TOP_K; W has 2 * n_out rows (gate, then up);
    the epilogue writes SiLU(gs_g * gate) * (gs_u * up) to out[row, n] in sorted-row order.
    Otherwise (GEMM2): A rows are the sorted rows; the epilogue writes gs * topk_weight * acc (fp32)
    to out[split, pair, n].
    """
    pid = tl.program_id(0)
    num_m_tiles = tl.load(num_tiles_ptr)
    num_n_tiles = tl.cdiv(n_out, BLOCK_N)
    total = num_m_tiles * num_n_tiles * SPLIT_K
    w_rows_total = 2 * n_out if GATED else n_out
    sfk = kp // 16
    k_per_split = kp // SPLIT_K
    for tile in range(pid, total, tl.num_programs(0)):
        split = tile % SPLIT_K
        mn = tile // SPLIT_K
        # Grouped order: GROUP_M token tiles share each weight tile while it is hot in L2.
        group = mn // (GROUP_M * num_n_tiles)
        first_m = group * GROUP_M
        group_m = tl.minimum(num_m_tiles - first_m, GROUP_M)
        in_group = mn % (GROUP_M * num_n_tiles)
        m_tile = first_m + in_group % group_m
        n_tile = in_group // group_m

        expert = tl.load(tile_expert_ptr + m_tile)
        row0 = tl.load(tile_row_ptr + m_tile)
        row_end = tl.load(offsets_ptr + expert + 1)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        pair = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
        if GATED:
            a_rows = pair // TOP_K
        else:
            a_rows = tl.where(row_ok, rows, row0)
        a_base = a_ptr + a_rows.to(tl.int64)[None, :] * stride_a

        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < n_out)[:, None]
        w_expert = w_ptr + expert.to(tl.int64) * w_rows_total * (kp // 2)
        s_expert = s_ptr + expert.to(tl.int64) * w_rows_total * sfk
        w_rows = w_expert + offs_n.to(tl.int64)[:, None] * (kp // 2)
        s_rows = s_expert + offs_n.to(tl.int64)[:, None] * sfk
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if GATED:
            w_up = w_rows + n_out * (kp // 2)
            s_up = s_rows + n_out * sfk
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)

        kb = tl.arange(0, BLOCK_K)
        k_start = split * k_per_split
        for k0 in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                a = tl.load(a_base + (k0 + kb)[:, None])
            else:
                a = tl.load(a_base + (k0 + kb)[:, None], mask=(k0 + kb < k)[:, None], other=0.0)
            acc = _dot_chunk(acc, w_rows, s_rows, k0, a, n_ok, BLOCK_N, BLOCK_K, DTYPE, USE_ASM, JOIN_HALVES)
            if GATED:
                acc_up = _dot_chunk(acc_up, w_up, s_up, k0, a, n_ok, BLOCK_N, BLOCK_K, DTYPE, USE_ASM, JOIN_HALVES)

        store_mask = n_ok & row_ok[None, :]
        fix = BF16_EPILOGUE_FIX if DTYPE == tl.bfloat16 else FP16_EPILOGUE_FIX
        if GATED:
            gate = acc * (tl.load(gs_ptr + expert * 2) * fix)
            up = acc_up * (tl.load(gs_ptr + expert * 2 + 1) * fix)
            act = gate / (1.0 + tl.exp(-gate)) * up
            out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
            tl.store(out_ptrs, act.to(DTYPE), mask=store_mask)
        else:
            weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
            y = acc * (tl.load(gs_ptr + expert) * fix * weight)[None, :]
            out_ptrs = out_ptr + split * stride_split + pair.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
            tl.store(out_ptrs, y, mask=store_mask)


@triton.jit
def _combine_kernel(
    partial_ptr,
    ids_ptr,
    expert_map_ptr,
    out_ptr,
    hidden,
    stride_split,
    TOP_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """out[t] = sum over k, then K splits, of partial[split, t * TOP_K + k] (fixed order)."""
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        pair_mask = mask
        if HAS_MAP:  # pairs routed to another rank were never written
            local = tl.load(expert_map_ptr + tl.load(ids_ptr + pair) + tl.zeros([BLOCK_H], tl.int32))
            pair_mask = mask & (local >= 0)
        for split in tl.static_range(SPLIT_K):
            row = partial_ptr + split * stride_split + pair.to(tl.int64) * hidden
            acc += tl.load(row + offs, mask=pair_mask, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * hidden + offs, acc.to(DTYPE), mask=mask)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (TRITON_INTERPRET=1) runs on CPU tensors
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def route(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Launch the routing kernel; returns (sorted_pairs, counts, offsets, tile_expert, tile_row, num_tiles)."""
    from ..routing import max_tiles

    num_pairs = topk_ids.numel()
    n_tiles = max_tiles(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    i32 = torch.int32
    sizes = (num_pairs, num_experts, num_experts + 1, num_experts, n_tiles, n_tiles, 1)
    ints = torch.empty(sum(sizes), dtype=i32, device=dev)
    sorted_pairs, counts, offsets, cursor, tile_expert, tile_row, num_tiles = torch.split(ints, sizes)
    ids = topk_ids.reshape(-1)
    _route_kernel[(1,)](
        ids,
        ids if expert_map is None else expert_map,
        sorted_pairs,
        counts,
        offsets,
        cursor,
        tile_expert,
        tile_row,
        num_tiles,
        num_pairs,
        num_experts,
        n_tiles,
        HAS_MAP=expert_map is not None,
        BLOCK_M=block_m,
        BLOCK_P=min(1024, triton.next_power_of_2(max(num_pairs, 16))),
        E_POW2=triton.next_power_of_2(num_experts),
        num_warps=8,
    )
    return sorted_pairs, counts, offsets, tile_expert, tile_row, num_tiles


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
    config: MoEKernelConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Host wrapper: shapes are checked by the caller (api.fused_moe); launches the four kernels."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13_packed.shape[0]
    out = torch.empty_like(x) if out is None else out
    if t == 0:
        return out
    dtype = _TL_DTYPES[x.dtype]
    use_asm = x.is_cuda  # the Triton interpreter runs on CPU tensors and has no inline PTX
    sorted_pairs, _, offsets, tile_expert, tile_row, num_tiles = route(
        topk_ids, num_experts, config.block_m, expert_map
    )
    num_pairs = t * top_k
    sms = _num_sms(x.device)
    k1p = w13_packed.shape[-1] * 2
    k2p = w2_packed.shape[-1] * 2
    act = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    g1, g2 = config.gemm1, config.gemm2
    _moe_gemm_kernel[(sms * g1.programs_per_sm,)](
        x, x.stride(0), w13_packed, w13_scale, w13_global, act, act.stride(0), 0,
        sorted_pairs, offsets, tile_expert, tile_row, num_tiles, topk_weights,
        intermediate, hidden, k1p,
        TOP_K=top_k, GATED=True, SPLIT_K=1, BLOCK_N=g1.block_n, BLOCK_M=config.block_m, BLOCK_K=128,
        GROUP_M=g1.group_m, EVEN_K=hidden == k1p, DTYPE=dtype, NUM_STAGES=g1.num_stages, USE_ASM=use_asm, JOIN_HALVES=g1.join_halves,
        num_warps=g1.num_warps,
    )  # fmt: skip
    partial = torch.empty(g2.split_k, num_pairs, hidden, dtype=torch.float32, device=x.device)
    _moe_gemm_kernel[(sms * g2.programs_per_sm,)](
        act, act.stride(0), w2_packed, w2_scale, w2_global, partial, partial.stride(1), partial.stride(0),
        sorted_pairs, offsets, tile_expert, tile_row, num_tiles, topk_weights.reshape(-1),
        hidden, intermediate, k2p,
        TOP_K=top_k, GATED=False, SPLIT_K=g2.split_k, BLOCK_N=g2.block_n, BLOCK_M=config.block_m, BLOCK_K=128,
        GROUP_M=g2.group_m, EVEN_K=intermediate == k2p, DTYPE=dtype, NUM_STAGES=g2.num_stages, USE_ASM=use_asm, JOIN_HALVES=g2.join_halves,
        num_warps=g2.num_warps,
    )  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(hidden))
    ids = topk_ids.reshape(-1)
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](
        partial, ids, ids if expert_map is None else expert_map, out, hidden, partial.stride(0),
        TOP_K=top_k, SPLIT_K=g2.split_k, HAS_MAP=expert_map is not None, BLOCK_H=block_h, DTYPE=dtype,
        num_warps=4,
    )  # fmt: skip
    return out
