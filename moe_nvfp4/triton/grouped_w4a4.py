"""W4A4 NVFP4 grouped GEMM for Hopper in Triton: per group g, out_g = alpha_g * A_g @ B_g^T.

A_g [M_g, K_g] and B_g [N_g, K_g] are packed e2m1 (K-major, even K in the low nibble) with e4m3 block
scales in the 128x4 swizzled layout.  Both operands are decoded in registers to bf16 by a few integer ops
and one packed multiply per value pair (DECODE_ASM): e2m1 times an e4m3 scale has at most 6 significant
bits, so each decoded value, code * scale * 2^-7, is exact and normal; the MMA accumulates in fp32 and the
epilogue multiplies by 2^14 and alpha_g * global_A * global_B.  On data whose products and sums are exact in
fp32 (power-of-two global scales and alpha) the result equals the reference bit for bit.

The packed bytes and scale words reach shared memory through the pipeliner's asynchronous copies
(num_stages); the decoded tiles go to shared memory for wgmma.  The K loop is mostly decode: 289 SASS
instructions per thread per 128x128x64 step (8 warps), against 4 wgmma of 512 tensor-core cycles.  Decode
per tile is (BM + BN) * BK values against BM * BN * BK MACs, hence the large default tile.

One persistent launch over every group's tiles: groups are found through the tile prefix sums
(``tile_starts``), their tensors through pointer arrays, as in CUTLASS's grouped GEMM.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import sm_count
from ..formats import NVFP4Tensor, grouped_operands
from .launcher import launch
from .scale_layout import swizzled_offset

__all__ = [
    "GroupedW4A4Plan",
    "plan_grouped_w4a4",
    "launch_grouped_w4a4",
    "plan_grouped_nvfp4",
    "grouped_gemm_nvfp4_triton",
]


# Decoded operands are value * 2^-7 in bf16 (code bits in the exponent LSBs: code * 2^-126, times the block
# scale * 2^119): every product is exact and normal, so the MMA never sees a subnormal; the accumulator holds
# the result times 2^-14, which the epilogue undoes exactly before alpha.
SCALE_BOOST: tl.constexpr = tl.constexpr(2.0**119)
ACC_FIX: tl.constexpr = tl.constexpr(2.0**14)

# One packed word $4 (bytes b0..b3) and each byte's scale word $5..$8 (bf16 bits of scale * 2^119) -> lo =
# low nibbles of b0..b3, hi = high nibbles, bf16, times their byte's scale: elementwise, so correct however
# Triton groups the bytes.  prmt 0x3120 puts b0, b1 in the two halves' low bytes and b2, b3 in their high
# bytes, so one shift and mask moves a nibble of both halves at once into bf16 bits 6..8 (magnitude) and 15
# (sign): code * 2^-126 (a subnormal for code 1, which mul.rn.bf16x2 takes exactly, as in sm90.gemm_triton).
DECODE_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 x, c, t, s01, s23;
prmt.b32 x, $4, 0, 0x3120;
prmt.b32 s01, $5, $6, 0x5410;
prmt.b32 s23, $7, $8, 0x5410;
shl.b32 c, x, 6; and.b32 c, c, 0x01C001C0; shl.b32 t, x, 12; and.b32 t, t, 0x80008000; or.b32 c, c, t;
mul.rn.bf16x2 $0, c, s01;
shr.b32 c, x, 2; and.b32 c, c, 0x01C001C0; shl.b32 t, x, 4; and.b32 t, t, 0x80008000; or.b32 c, c, t;
mul.rn.bf16x2 $1, c, s23;
shl.b32 c, x, 2; and.b32 c, c, 0x01C001C0; shl.b32 t, x, 8; and.b32 t, t, 0x80008000; or.b32 c, c, t;
mul.rn.bf16x2 $2, c, s01;
shr.b32 c, x, 6; and.b32 c, c, 0x01C001C0; and.b32 t, x, 0x80008000; or.b32 c, c, t;
mul.rn.bf16x2 $3, c, s23;
}""")
# (left shift of the word, left shift bringing the sign bit to bit 15) per output register, as in the PTX
NIBBLE_SHIFTS: tl.constexpr = tl.constexpr(((6, 12), (-2, 4), (2, 8), (-6, 0)))


@triton.jit
def _e4m3_values(byte):
    """e4m3 bytes (int32, sign bit clear: block scales are positive) -> float32, built from the bits."""
    exp = (byte >> 3) & 15
    man = byte & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # bias 7 -> 127
    return tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9


@triton.jit
def _scale_words(scale_bytes):
    """e4m3 block scales (uint32) -> uint32 holding the bf16 bits of scale * 2^119 (exact: 4 significant bits)."""
    boosted = (_e4m3_values(scale_bytes.to(tl.int32)) * SCALE_BOOST).to(tl.bfloat16)
    return boosted.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _shift(x, left: tl.constexpr):
    """x << left, or x >> -left for a negative shift (PTX's shl / shr)."""
    if left >= 0:
        return x << left
    return x >> -left


@triton.jit
def _bf16_bits_value(bits):
    """float32 value of the bf16 bits in the low half of uint32 ``bits`` (the interpreter flushes bf16
    subnormals, such as code 1 here, when it converts bf16 itself)."""
    return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _decode_portable(packed, scales, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """DECODE_ASM step by step in plain Triton on [ROWS, BYTES / 4] words (the interpreter has no inline PTX)."""
    b01, b23 = tl.split(tl.reshape(packed.to(tl.uint32), [ROWS, BYTES // 4, 2, 2]))
    b0, b1 = tl.split(b01)
    b2, b3 = tl.split(b23)
    x = b0 | (b2 << 8) | (b1 << 16) | (b3 << 24)  # prmt 0x3120
    s01, s23 = tl.split(tl.reshape(scales, [ROWS, BYTES // 4, 2, 2]))
    s0, s1 = tl.split(s01)
    s2, s3 = tl.split(s23)
    halves = []
    for i in tl.static_range(4):
        code = (_shift(x, NIBBLE_SHIFTS[i][0]) & 0x01C001C0) | ((x << NIBBLE_SHIFTS[i][1]) & 0x80008000)
        for half in tl.static_range(2):
            scale = (s0, s1, s2, s3)[2 * (i % 2) + half]  # registers 0, 2 take b0, b1's scales; 1, 3 b2, b3's
            product = _bf16_bits_value(code >> (16 * half)) * _bf16_bits_value(scale)  # exact
            halves.append(product.to(tl.bfloat16))  # so the interpreter's truncating cast is harmless
    # halves: register r, half h; lo = registers 0, 1 (b0 b1 | b2 b3), hi = registers 2, 3
    lo = tl.join(tl.join(halves[0], halves[1]), tl.join(halves[2], halves[3]))
    hi = tl.join(tl.join(halves[4], halves[5]), tl.join(halves[6], halves[7]))
    return tl.reshape(lo, [ROWS, BYTES]), tl.reshape(hi, [ROWS, BYTES])


@triton.jit
def _load_operand(
    ptr,
    scale_ptr,
    row0,
    rows_total,
    k0,
    k,
    scale_col_blocks,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Rows row0.. of one operand, K columns k0..k0+BLOCK_K: bf16 [ROWS, BLOCK_K], value * 2^-7 (exact), K in
    the order k0 k2 k1 k3 within each group of four (the same for A and B, so the dot is unchanged)."""
    rows = row0 + tl.arange(0, ROWS)
    bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ptrs = ptr + rows.to(tl.int64)[:, None] * (k // 2) + bytes_[None, :]
    # A row's four scales of one 64-wide K chunk are one aligned word of the swizzled layout: 32-bit loads,
    # which the pipeliner copies asynchronously like the packed values.
    chunks = k0 // 64 + tl.arange(0, BLOCK_K // 64)
    word_ptrs = scale_ptr + swizzled_offset(rows[:, None], 4 * chunks[None, :], scale_col_blocks).to(tl.int64) // 4
    row_ok = (rows < rows_total)[:, None]
    if EVEN_K:
        packed = tl.load(ptrs, mask=row_ok, other=0)
        words = tl.load(word_ptrs, mask=row_ok, other=0)
    else:
        packed = tl.load(ptrs, mask=row_ok & (bytes_ < k // 2)[None, :], other=0)
        words = tl.load(word_ptrs, mask=row_ok & (chunks < scale_col_blocks)[None, :], other=0)
    scale_bytes = tl.reshape((words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF, [ROWS, BLOCK_K // 16])
    if not EVEN_K:  # scale columns past K (padding, not necessarily finite) scale masked zeros: make them 0
        scale_bytes = tl.where((k0 // 16 + tl.arange(0, BLOCK_K // 16) < k // 16)[None, :], scale_bytes, 0)
    # each byte's scale word, per byte (the decode is elementwise: any register grouping is correct)
    words = _scale_words(scale_bytes)
    scales = tl.reshape(tl.broadcast_to(words[:, :, None], [ROWS, BLOCK_K // 16, 8]), [ROWS, BLOCK_K // 2])
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            DECODE_ASM,
            "=r,=r,=r,=r,r,r,r,r,r",
            [packed, scales],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        lo, hi = _decode_portable(packed, scales, ROWS, BLOCK_K // 2)
    # pairs of lo (and of hi) values sit in one register: keep them adjacent in K, as wgmma wants pairs
    pairs = tl.permute(tl.reshape(tl.join(lo, hi), [ROWS, BLOCK_K // 4, 2, 2]), (0, 1, 3, 2))
    return tl.reshape(pairs, [ROWS, BLOCK_K])


@triton.jit
def _grouped_w4a4_kernel(
    a_ptrs,
    b_ptrs,
    sa_ptrs,
    sb_ptrs,
    out_ptrs,
    sizes_ptr,
    tile_starts_ptr,
    alpha_ptr,
    num_groups,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    total = tl.load(tile_starts_ptr + num_groups)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        g = 0
        for h in range(1, num_groups):  # groups are few (the benchmark has up to 8): a scan is enough
            g += (tl.load(tile_starts_ptr + h) <= tile).to(tl.int32)
        m = tl.load(sizes_ptr + 3 * g)
        n = tl.load(sizes_ptr + 3 * g + 1)
        k = tl.load(sizes_ptr + 3 * g + 2)
        local = tile - tl.load(tile_starts_ptr + g)
        tiles_n = tl.cdiv(n, BLOCK_N)
        row0 = (local // tiles_n) * BLOCK_M
        col0 = (local % tiles_n) * BLOCK_N
        a = tl.load(a_ptrs + g).to(tl.pointer_type(tl.uint8))
        b = tl.load(b_ptrs + g).to(tl.pointer_type(tl.uint8))
        sa = tl.load(sa_ptrs + g).to(tl.pointer_type(tl.uint32))
        sb = tl.load(sb_ptrs + g).to(tl.pointer_type(tl.uint32))
        if EVEN_K:  # every row of packed bytes starts 16-byte aligned: vector loads
            k = tl.multiple_of(k, BLOCK_K)
            a = tl.multiple_of(a, 16)
            b = tl.multiple_of(b, 16)
        scale_col_blocks = tl.cdiv(k // 16, 4)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            a_tile = _load_operand(a, sa, row0, m, k0, k, scale_col_blocks, BLOCK_M, BLOCK_K, EVEN_K, USE_ASM)
            b_tile = _load_operand(b, sb, col0, n, k0, k, scale_col_blocks, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM)
            if USE_ASM:
                acc = tl.dot(a_tile, tl.trans(b_tile), acc)
            else:  # the interpreter's dot has no bf16; float32 holds the same values exactly
                acc = tl.dot(a_tile.to(tl.float32), tl.trans(b_tile.to(tl.float32)), acc, input_precision="ieee")
        out = tl.load(out_ptrs + g).to(tl.pointer_type(OUT_DTYPE))
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        y = (acc * ACC_FIX * tl.load(alpha_ptr + g)).to(OUT_DTYPE)
        tl.store(
            out + rows.to(tl.int64)[:, None] * n + cols[None, :], y, mask=(rows < m)[:, None] & (cols < n)[None, :]
        )


_TL_OUT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class GroupedW4A4Plan:
    """Everything one launch needs, built once on the host: outputs, pointer arrays, sizes, tile prefix sums.
    ``launch_grouped_w4a4(plan)`` then only launches the kernel, so it can be captured in a CUDA graph and
    replayed after writing new values into the same input tensors."""

    outs: list[torch.Tensor]
    inputs: tuple[list[torch.Tensor], ...]  # held so the memory the pointers name stays alive
    pointers: tuple[torch.Tensor, ...]  # int64 [G] each: A, B, A scales, B scales, outputs
    sizes: torch.Tensor  # int32 [G, 3]: M, N, K
    tile_starts: torch.Tensor  # int32 [G + 1]
    alpha: torch.Tensor  # float32 [G]
    total_tiles: int
    grid: int
    out_dtype: torch.dtype
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    even_k: bool  # every group's K is a multiple of block_k: no K masks, aligned vector loads


WIDE_TILE_WAVES = 4  # see plan_grouped_w4a4


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def plan_grouped_w4a4(
    a_packed: list[torch.Tensor],
    a_scales: list[torch.Tensor],
    b_packed: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    block_m: int = 128,
    block_n: int | None = None,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
) -> GroupedW4A4Plan:
    """Inputs checked by api.plan_grouped_gemm_nvfp4: packed [M_g, K_g/2] / [N_g, K_g/2] uint8, swizzled e4m3
    scales, alpha float32 [G] (already times both global scales); outputs out_dtype [M_g, N_g].

    Default tile 128x{128, 256}x64, 8 warps (two warpgroups), 3 stages: per MAC it decodes half what a 64x64
    tile does and stays spill-free (178 registers at N=128).  ``block_n=None`` takes 256 where 128-wide tiles
    would need more than WIDE_TILE_WAVES waves over the SMs: a 128x256 tile costs about 1.57x a 128x128 one
    (less decode per MAC), which only pays when the last, partly filled wave is a small share.  Measured on
    an H200 (2026-11-22), µs for 128x128 / 128x256 on the four benchmark shapes: 329 / 347, 206 / 159,
    67 / 106, 27 / 43; the rule picks the faster of each pair."""
    if block_k % 64:
        raise ValueError(f"block_k must be a multiple of 64 (one scale word per row and 64 K), got {block_k}")
    device = a_packed[0].device
    # vector loads want 16-byte aligned packed rows and 4-byte aligned scale words: the rare view that starts
    # elsewhere is copied once here (the plan holds and reads the copy)
    a_packed, b_packed, a_scales, b_scales = (
        [_aligned(t) for t in ts] for ts in (a_packed, b_packed, a_scales, b_scales)
    )
    sizes = [(a.shape[0], b.shape[0], a.shape[1] * 2) for a, b in zip(a_packed, b_packed)]
    sms = sm_count(device, off_gpu=2)

    def tiles_per_group(tile_n: int) -> list[int]:
        return [triton.cdiv(m, block_m) * triton.cdiv(n, tile_n) for m, n, _ in sizes]

    if block_n is None:
        block_n = 256 if sum(tiles_per_group(128)) > WIDE_TILE_WAVES * sms else 128
    outs = [torch.empty(m, n, dtype=out_dtype, device=device) for m, n, _ in sizes]
    tile_starts = [0, *itertools.accumulate(tiles_per_group(block_n))]

    def pointer_array(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)

    scales_a = [s.view(torch.uint8) for s in a_scales]
    scales_b = [s.view(torch.uint8) for s in b_scales]
    return GroupedW4A4Plan(
        outs=outs,
        inputs=(a_packed, a_scales, b_packed, b_scales),
        pointers=tuple(pointer_array(ts) for ts in (a_packed, b_packed, scales_a, scales_b, outs)),
        sizes=torch.tensor(sizes, dtype=torch.int32, device=device).reshape(-1, 3),
        tile_starts=torch.tensor(tile_starts, dtype=torch.int32, device=device),
        alpha=alpha,
        total_tiles=tile_starts[-1],
        grid=min(tile_starts[-1], 2 * sms),
        out_dtype=out_dtype,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        even_k=all(k % block_k == 0 for _, _, k in sizes),
    )


def launch_grouped_w4a4(plan: GroupedW4A4Plan) -> list[torch.Tensor]:
    """One persistent launch (nothing else: no allocation, no host-to-device copy); returns plan.outs."""
    if plan.total_tiles:
        launch(
            _grouped_w4a4_kernel,
            (plan.grid,),
            *plan.pointers,
            plan.sizes,
            plan.tile_starts,
            plan.alpha,
            plan.sizes.shape[0],
            OUT_DTYPE=_TL_OUT[plan.out_dtype],
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k,
            EVEN_K=plan.even_k,
            USE_ASM=plan.sizes.is_cuda,  # the interpreter runs on CPU tensors, without PTX
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
    return plan.outs


def plan_grouped_nvfp4(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], *, alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> GroupedW4A4Plan:
    """The triton backend's ``plan_grouped_gemm`` (inputs checked by the API)."""
    operands, scale = grouped_operands(a, b, alpha)
    return plan_grouped_w4a4(*operands, scale, out_dtype)


def grouped_gemm_nvfp4_triton(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], *, alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The triton backend's ``grouped_gemm``: plan, then one launch."""
    return launch_grouped_w4a4(plan_grouped_nvfp4(a, b, alpha=alpha, out_dtype=out_dtype))
