"""128x4 swizzled scale layout: element-by-element against the documented formula, inverse, padding.

Expected positions come from ``swizzled_offset`` (the formula of the layouts.py docstring) evaluated one
element at a time in Python, and from a byte-for-byte hand-written example.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_nvfp4.formats import NVFP4Tensor, ScaleLayout, dequantize_nvfp4, quantize_nvfp4
from moe_nvfp4.layouts import (
    padded_scale_shape,
    rows_16_aligned,
    swizzle_scales_128x4,
    swizzled_offset,
    unswizzle_scales_128x4,
)

# Tolerance bounds of this file: layouts move bytes, so every check is bit-exact.
TOL = {"swizzle": 0.0, "unswizzle": 0.0, "dequantize_either_layout": 0.0}

# (rows, scale_cols) cases and why each exists.
SHAPES = {
    "one_tile": (128, 4),
    "rows_not_multiple_of_128": (130, 4),
    "cols_not_multiple_of_4": (128, 5),
    "both_odd": (257, 7),
    "tiny": (1, 1),
    "many_col_blocks": (33, 13),
}


def random_scales(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random e4m3 bytes, all nonzero so padding (zero) can be told apart from data."""
    return torch.randint(1, 0x7F, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)


def check_against_formula(scales: torch.Tensor, swizzled: torch.Tensor) -> None:
    rows, cols = scales.shape[-2:]
    prow, pcol = padded_scale_shape(rows, cols)
    assert swizzled.shape == (*scales.shape[:-2], prow, pcol)
    src = scales.view(torch.uint8).reshape(-1, rows, cols)
    dst = swizzled.view(torch.uint8).reshape(-1, prow * pcol)
    for b in range(src.shape[0]):
        flat = dst[b].tolist()
        image = src[b].tolist()
        hit = [False] * (prow * pcol)
        for i in range(rows):
            for j in range(cols):
                off = swizzled_offset(i, j, cols)
                assert flat[off] == image[i][j], (b, i, j, off)
                hit[off] = True
        padding = [flat[o] for o in range(prow * pcol) if not hit[o]]
        assert all(v == 0 for v in padding), "padding bytes must be zero"
        assert sum(hit) == rows * cols  # no two elements share a byte


@pytest.mark.parametrize("rows, cols", SHAPES.values(), ids=SHAPES.keys())
def test_swizzle_matches_formula(gen, rows, cols):
    scales = random_scales(gen, (rows, cols))
    check_against_formula(scales, swizzle_scales_128x4(scales))


def test_swizzle_batched_matches_formula_per_expert(gen):
    scales = random_scales(gen, (3, 130, 5))
    swz = swizzle_scales_128x4(scales)
    check_against_formula(scales, swz)
    for e in range(3):
        assert torch.equal(swz[e].view(torch.uint8), swizzle_scales_128x4(scales[e]).view(torch.uint8))
    nested = random_scales(gen, (2, 2, 40, 3))
    check_against_formula(nested, swizzle_scales_128x4(nested))


def test_swizzle_hand_example():
    """Row i, column j of a [128, 4] matrix lands at (i % 32) * 16 + (i // 32) * 4 + j."""
    scales = torch.arange(128 * 4, dtype=torch.int32).reshape(128, 4)
    flat = swizzle_scales_128x4(scales).flatten().tolist()
    assert flat[:8] == [0, 1, 2, 3, 128, 129, 130, 131]  # rows 0 and 32 share the first 16 bytes
    assert flat[16:20] == [4, 5, 6, 7]  # row 1
    assert flat[12:16] == [96 * 4, 96 * 4 + 1, 96 * 4 + 2, 96 * 4 + 3]  # row 96
    # Column block 1 of a [128, 8] matrix starts at byte 512.
    wide = torch.arange(128 * 8, dtype=torch.int32).reshape(128, 8)
    assert swizzle_scales_128x4(wide).flatten().tolist()[512:516] == [4, 5, 6, 7]


def test_swizzled_offset_vectorized_matches_scalar():
    i = torch.arange(300)[:, None]
    j = torch.arange(9)[None, :]
    vec = swizzled_offset(i, j, 9)
    assert vec.tolist() == [[swizzled_offset(a, b, 9) for b in range(9)] for a in range(300)]
    assert sorted(vec.flatten().tolist()) == sorted(set(vec.flatten().tolist()))  # injective


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    rows=st.integers(1, 300),
    cols=st.integers(1, 12),
)
def test_unswizzle_inverts_swizzle(seed, batch, rows, cols):
    gen = torch.Generator().manual_seed(seed)
    scales = random_scales(gen, (*batch, rows, cols))
    swz = swizzle_scales_128x4(scales)
    back = unswizzle_scales_128x4(swz, rows, cols)
    assert back.dtype == scales.dtype
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def test_unswizzle_ignores_garbage_in_padding(gen):
    rows, cols = 130, 5
    scales = random_scales(gen, (2, rows, cols))
    swz = swizzle_scales_128x4(scales).view(torch.uint8).clone()
    offsets = swizzled_offset(torch.arange(rows)[:, None], torch.arange(cols)[None, :], cols).flatten()
    used = torch.zeros(swz[0].numel(), dtype=torch.bool)
    used[offsets] = True
    garbage = torch.randint(0, 256, swz.shape, generator=gen, dtype=torch.uint8)
    dirty = torch.where(used.reshape(swz.shape[1:]), swz, garbage)
    back = unswizzle_scales_128x4(dirty.view(torch.float8_e4m3fn), rows, cols)
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def test_nvfp4_tensor_layout_switch(gen):
    q = quantize_nvfp4(torch.randn(3, 130, 80, generator=gen))  # 5 scale columns, 130 rows
    s = q.swizzled_scales()
    assert s.scale_layout is ScaleLayout.SWIZZLED_128x4 and s.block_scale.shape == (3, 256, 8)
    assert s.swizzled_scales() is s and q.linear_scales() is q
    assert torch.equal(s.linear_scales().block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(s), dequantize_nvfp4(q))


def test_bad_shapes_raise(gen):
    scales = random_scales(gen, (130, 5))
    swz = swizzle_scales_128x4(scales)
    assert unswizzle_scales_128x4(swz, 129, 5).shape == (129, 5)  # 129 rows also pad to 256: allowed
    with pytest.raises(ValueError, match="do not hold"):
        unswizzle_scales_128x4(swz, 130, 9)
    with pytest.raises(ValueError, match="do not hold"):
        unswizzle_scales_128x4(swz, 100, 5)
    with pytest.raises(ValueError, match="do not hold"):
        unswizzle_scales_128x4(scales, 130, 5)  # a linear matrix is not a swizzled one
    with pytest.raises(ValueError, match="N, SFK"):
        swizzle_scales_128x4(scales[0])
    with pytest.raises(ValueError):
        unswizzle_scales_128x4(swz.flatten(), 130, 5)
    with pytest.raises(ValueError, match="do not hold"):
        packed = torch.zeros(130, 40, dtype=torch.uint8)
        NVFP4Tensor(packed, swz[:128], torch.tensor(1.0), ScaleLayout.SWIZZLED_128x4).linear_scales()


# ---- FragmentLayout (the sm_90 kernel's weight layout) ----


@pytest.mark.parametrize("n,k", [(64, 128), (100, 48), (130, 400), (8, 16)])
def test_fragment_layout_places_every_element(n: int, k: int, gen: torch.Generator) -> None:
    """Every code sits at the bit positions the layout's docstring names, every scale in its slot; pack/unpack
    round-trip (a zero-scale block comes back with zero codes)."""
    from moe_nvfp4.formats import pack_fp4, unpack_fp4
    from moe_nvfp4.layouts import FRAGMENT_WORD_BITS, FragmentLayout, decode_scale_e5m3

    layout = FragmentLayout()
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.randint(1, 127, (n, k // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales.view(torch.uint8)[0, 0] = 0
    values, sbytes = layout.pack(pack_fp4(codes), scales)
    np_, kp = layout.padded_n(n), layout.padded_k(k)
    assert values.shape == (np_, kp // 2) and sbytes.shape == (np_, kp // 16)
    flat, sflat = values.flatten().to(torch.int64), sbytes.flatten()
    expected = torch.zeros(np_, kp, dtype=torch.int64)
    expected[:n, :k] = codes
    expected[0, :16] = 0
    chunks = kp // 128
    for row in range(0, np_, 7):
        for kk in range(0, kp, 5):
            unit, rr, c, kc = row // 64, row % 64, kk // 128, kk % 128
            warp, rh, r = rr // 16, (rr % 16) // 8, rr % 8
            g, kh, q, kpair = kc // 16, (kc % 16) // 8, (kc % 8) // 2, kc % 2
            word_at = ((unit * chunks + c) * 128 + warp * 32 + r * 4 + q) * 32 + g * 4
            word = sum(int(flat[word_at + b]) << (8 * b) for b in range(4))
            got = sum(((word >> pos) & 1) << bit for bit, pos in enumerate(FRAGMENT_WORD_BITS[4 * rh + 2 * kh + kpair]))
            assert got == expected[row, kk], (row, kk)
            scale = sflat[((unit * chunks + c) * 32 + warp * 8 + r) * 16 + g * 2 + rh]
            want = scales[row, kk // 16].float() if row < n and kk < k else torch.tensor(0.0)
            assert decode_scale_e5m3(scale) == want, (row, kk)
    packed, back = layout.unpack(values, sbytes, n, k)
    assert torch.equal(unpack_fp4(packed), expected[:n, :k].to(torch.uint8))
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def test_scale_byte_decodes_exactly_to_biased_bf16_and_fp16() -> None:
    """Every non-negative e4m3 (subnormals included) -> byte -> the kernel's shift-and-add decode is exact."""
    from moe_nvfp4.layouts import decode_scale_e5m3, encode_scale_e5m3

    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    byte = encode_scale_e5m3(e4m3)
    assert torch.equal(decode_scale_e5m3(byte), e4m3.float())
    b = byte.to(torch.int32)
    bf16 = ((b << 4) + 0x7000).to(torch.int16).view(torch.bfloat16).float()
    fp16 = ((b << 7) + 0x1400).to(torch.int16).view(torch.float16).float()
    nonzero = e4m3.float() > 0
    assert torch.equal(bf16[nonzero], e4m3.float()[nonzero] * 2.0**107)
    assert torch.equal(fp16[nonzero], e4m3.float()[nonzero])


def test_fragment_layout_rejects_wrong_shape() -> None:
    from moe_nvfp4.layouts import FragmentLayout

    with pytest.raises(ValueError, match="do not hold"):
        FragmentLayout().unpack(torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 8, dtype=torch.uint8), 64, 256)


def test_rows_16_aligned_is_what_the_gluon_gemms_read() -> None:
    """Data on a 16-byte boundary and a row stride of 16 elements or a multiple: contiguous rows of H = 16 k are,
    a column slice of a wider buffer (even one row of it) and a view one element in are not (ops._readable_rows
    copies those on a GPU)."""
    buf = torch.zeros(4, 19, dtype=torch.float16)
    flat = torch.zeros(65, dtype=torch.bfloat16)
    assert rows_16_aligned(torch.zeros(3, 48, dtype=torch.float16))
    assert not rows_16_aligned(buf[:, :16]) and not rows_16_aligned(buf[:1, :16])
    assert not rows_16_aligned(flat[1:].view(4, 16))
    assert rows_16_aligned(flat[:64].view(4, 16)) == (flat.data_ptr() % 16 == 0)


def test_next_pow2_is_tritons() -> None:
    """The host's next_pow2 gives triton.next_power_of_2's value for every size the forward asks about."""
    import triton

    from moe_nvfp4.layouts import next_pow2

    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 70000))
