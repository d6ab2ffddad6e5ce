"""Activation quantization in Triton: bf16/fp16/fp32 [M, K] -> NVFP4 with 128x4-swizzled e4m3 scales.

Byte for byte the reference ``formats.quantize_activations_nvfp4`` followed by ``layouts.swizzle_scales_128x4``
(its pure-torch twin): the same float32 operations in the same order, IEEE division (``div_rn``; Triton's
plain ``/`` may lower to an approximate division), and the e4m3 rounding of the block scales done on the
float32 bits (round to nearest even, subnormals included) rather than by a float8 cast whose emulation in
the interpreter could differ.  One program quantizes a BLOCK_M x BLOCK_K tile; padding rows and columns of
the swizzled scale matrix stay zero, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import NVFP4, NVFP4Tensor, ScaleLayout
from ..layouts import padded_scale_shape
from .launcher import launch
from .scale_layout import swizzled_offset

__all__ = ["quantize_activations_sm90"]

E4M3_ONE: tl.constexpr = tl.constexpr(0x38)  # the e4m3 byte of 1.0, the scale of a block that rounds to zero
E4M3_NAN: tl.constexpr = tl.constexpr(0x7F)  # the scale of a block holding NaN or inf (formats._quantize)


@triton.jit
def _round_e4m3(s):
    """float32 s in [0, 448] -> (s rounded to e4m3, round to nearest even, as float32; its e4m3 byte)."""
    bits = s.to(tl.int32, bitcast=True)
    # normal (s >= 2^-6): drop 20 of the 23 mantissa bits with round-to-nearest-even; a carry bumps the exponent
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    normal_byte = (((kept >> 23) - 120) << 3) | ((kept >> 20) & 7)  # exponent bias 127 -> 7
    # subnormal (s < 2^-6): multiples of 2^-9; adding 2^23 rounds s * 2^9 (< 8, exact) to an integer, RNE
    steps = (s * 512.0 + 8388608.0) - 8388608.0
    is_normal = s >= 0.015625
    value = tl.where(is_normal, normal, steps * 0.001953125)
    byte = tl.where(is_normal, normal_byte, steps.to(tl.int32))  # 8 steps = 2^-6 = byte 0x08, the same bits
    return value, byte


@triton.jit
def _encode_e2m1(v):
    """float32 -> e2m1 code 0..15: nearest magnitude, ties to the even code, saturating at 6; sign from the
    sign bit (so -0 and small negatives give code 8), as formats.encode_e2m1."""
    mag = tl.abs(v)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32) + (mag > 5.0).to(tl.int32)
    negative = v.to(tl.int32, bitcast=True) < 0
    return code | (negative.to(tl.int32) << 3)


@triton.jit
def _quantize_act_kernel(
    x_ptr,
    stride_x,
    gs_ptr,
    packed_ptr,
    scale_ptr,
    m,
    k,
    scale_col_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < m)[:, None] & (cols < k)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr)

    blocks = tl.reshape(x, [BLOCK_M, BLOCK_K // 16, 16])
    amax = tl.max(tl.abs(blocks), axis=2)
    scale = tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32) * gs), 448.0)
    scale, scale_byte = _round_e4m3(scale)
    zero = scale == 0.0  # all-zero (or too small) block: scale 1.0, codes 0
    scale = tl.where(zero, 1.0, scale)
    scale_byte = tl.where(zero, E4M3_ONE, scale_byte)
    # NaN propagates (as through a 16-bit GEMM): a block holding NaN or inf, or every block under a NaN global
    # scale (api: input_scale_or_nan), gets a NaN scale and codes 0.  |v| < inf is false for NaN and inf alike;
    # tl.max would drop a NaN on the GPU.
    finite = tl.min((tl.abs(blocks) < float("inf")).to(tl.int32), axis=2)  # 1, or 0 where NaN or inf
    poisoned = finite - (gs != gs).to(tl.int32) < 1
    scale_byte = tl.where(poisoned, E4M3_NAN, scale_byte)

    codes = _encode_e2m1(tl.math.div_rn(blocks, (scale * gs)[:, :, None]))
    codes = tl.where(poisoned[:, :, None], 0, codes)
    even, odd = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_K // 2, 2]))
    pairs = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pair_ok = (rows < m)[:, None] & (pairs < k // 2)[None, :]
    tl.store(
        packed_ptr + rows.to(tl.int64)[:, None] * (k // 2) + pairs[None, :],
        (even | (odd << 4)).to(tl.uint8),
        mask=pair_ok,
    )

    # 128x4 blocked layout (layouts.swizzled_offset): 512-byte tiles of 128 rows x 4 scale columns
    j = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    i = rows[:, None]
    offset = swizzled_offset(i, j[None, :], scale_col_blocks)
    tl.store(
        scale_ptr + offset.to(tl.int64), scale_byte.to(tl.uint8), mask=(rows < m)[:, None] & (j < k // 16)[None, :]
    )


def quantize_activations_sm90(x: torch.Tensor, input_global_scale: torch.Tensor) -> NVFP4Tensor:
    """Host wrapper, the triton backend's ``quantize`` (inputs checked by api.quantize_activations; the global
    scale 0-dim, NaN where it was unusable): packed uint8 [M, K/2], e4m3 scales [pad128(M), pad4(K/16)] in the
    128x4 blocked layout."""
    x = x.contiguous()
    m, k = x.shape
    prow, pcol = padded_scale_shape(m, k // NVFP4.block_size)
    packed = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.zeros(prow, pcol, dtype=NVFP4.scale_dtype, device=x.device)
    result = NVFP4Tensor(packed, scales, input_global_scale, ScaleLayout.SWIZZLED_128x4)
    if m == 0:
        return result
    block_k = min(128, triton.next_power_of_2(k))
    block_m = 32
    launch(
        _quantize_act_kernel,
        (triton.cdiv(m, block_m), triton.cdiv(k, block_k)),
        x,
        x.stride(0),
        input_global_scale.reshape(1),
        packed,
        scales.view(torch.uint8),
        m,
        k,
        pcol // 4,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return result
