"""NVFP4 format: e2m1 codes, rounding, packing, block/global scales, quantize/dequantize round trips.

The expected values are written out here (code table, midpoints) or computed by an independent rounding
rule (``ref_round_e2m1``: round-half-even on the 0.5 / 1 / 2 sub-grids), never by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_nvfp4.formats import (
    E2M1_VALUES,
    NVFP4,
    NVFP4Tensor,
    decode_e2m1,
    dequantize_nvfp4,
    encode_e2m1,
    global_scale_for,
    pack_fp4,
    quantize_activations_nvfp4,
    quantize_nvfp4,
    unpack_fp4,
)

# Tolerance bounds of this file.
TOL = {
    # ||dequant(quant(w)) - w|| / ||w|| for N(0, 1) weights.  Measured 0.095: a 16-element gaussian block
    # spans about +-2 sigma, so the step is ~sigma/3 near zero and the RMS rounding error ~ step/sqrt(12)
    # ~ 0.1 sigma.  0.11 leaves ~15% margin, while round-toward-zero or a wrong block scale gives > 0.15.
    "gaussian_rel_error": 0.11,
    # The per-element bound |err| <= scale * global * gap / 2 is evaluated in float64 from float32
    # operands; this relative slack covers the float32 rounding of the dequantized product.
    "half_step_rel_slack": 1e-6,
    # Round trips of values on the grid, batched vs per-expert, segments, activations: bit-exact.
    "exact": 0.0,
}

# The 16 codes, written out: bit 3 is the sign, bits 0-2 index the magnitudes.
CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MAGNITUDES = CODE_VALUES[:8]


def ref_round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Independent e2m1 rounding: nearest on the sub-grids 0.5 (< 2), 1 (< 4), 2 (< 6), ties to the even
    multiple (= even code), saturating at 6.  Returns float64 values with the sign of x (-0 kept)."""
    m = x.double().abs()
    r = torch.where(m < 2, torch.round(m * 2) / 2, torch.where(m < 4, torch.round(m), torch.round(m / 2) * 2)).clamp(
        max=6.0
    )
    return torch.where(torch.signbit(x), -r, r)


def value_to_code(v: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(MAGNITUDES, dtype=torch.float64)
    idx = (v.double().abs().unsqueeze(-1) == mag).to(torch.uint8).argmax(-1).to(torch.uint8)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def e4m3_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def grid_tensor(gen: torch.Generator, batch: tuple[int, ...], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes [*batch, n, k] with one +-6 per 16-block (so the block amax is 6 * scale), and random
    positive finite e4m3 block scales [*batch, n, k/16]: bytes 0x01 (2^-9, subnormal) to 0x7E (448)."""
    codes = torch.randint(0, 16, (*batch, n, k // 16, 16), generator=gen, dtype=torch.uint8)
    pos = torch.randint(0, 16, (*batch, n, k // 16, 1), generator=gen)
    six = torch.where(torch.rand(pos.shape, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    codes.scatter_(-1, pos, six)
    scales = e4m3_from_bytes(torch.randint(0x01, 0x7F, (*batch, n, k // 16), generator=gen))
    return codes.reshape(*batch, n, k), scales


# ----------------------------------------------------------------------------------------------------
# e2m1 codes


def test_all_16_codes_decode():
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    want = torch.tensor(CODE_VALUES)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # code 8 is -0, code 0 is +0
    assert torch.equal(E2M1_VALUES, want) and torch.equal(torch.signbit(E2M1_VALUES), torch.signbit(want))
    for code, value in [(4, 2.0), (5, 3.0), (6, 4.0), (7, 6.0), (12, -2.0), (13, -3.0), (14, -4.0), (15, -6.0)]:
        assert decode_e2m1(torch.tensor([code], dtype=torch.uint8)).item() == value


def test_grid_values_encode_to_their_code():
    values = torch.tensor(CODE_VALUES)
    assert encode_e2m1(values).tolist() == list(range(16))
    assert encode_e2m1(values.double()).tolist() == list(range(16))
    assert encode_e2m1(values.to(torch.bfloat16)).tolist() == list(range(16))


@pytest.mark.parametrize(
    "midpoint, expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
def test_ties_to_even(midpoint, expected, sign):
    x = torch.tensor([sign * midpoint])
    code = encode_e2m1(x)
    assert code.item() == value_to_code(torch.tensor([sign * expected])).item()
    assert code.item() % 2 == 0  # the even code wins every tie
    # Just off the midpoint the nearer neighbour wins.
    lo = MAGNITUDES[MAGNITUDES.index(expected) - 1] if expected > midpoint else expected
    hi = expected if expected > midpoint else MAGNITUDES[MAGNITUDES.index(expected) + 1]
    below = torch.nextafter(torch.tensor([midpoint]), torch.tensor([0.0])) * sign
    above = torch.nextafter(torch.tensor([midpoint]), torch.tensor([10.0])) * sign
    assert decode_e2m1(encode_e2m1(below)).item() == sign * lo
    assert decode_e2m1(encode_e2m1(above)).item() == sign * hi


@pytest.mark.parametrize("value", [6.0001, 6.5, 7.0, 100.0, 1e30, math.inf])
def test_saturation_above_6(value):
    assert encode_e2m1(torch.tensor([value, -value])).tolist() == [7, 15]


def test_negative_values_rounding_to_zero_keep_the_sign():
    assert encode_e2m1(torch.tensor([-0.0, -0.1, -0.25, 0.0, 0.1, 0.25])).tolist() == [8, 8, 8, 0, 0, 0]


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_encode_matches_independent_rounding(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(encode_e2m1(x), value_to_code(ref_round_e2m1(x)))


def test_encode_matches_independent_rounding_dense(gen):
    x = torch.randn(1 << 16, generator=gen) * 4
    x[:64] = torch.arange(64) * 0.125 - 4  # every quarter-step point, midpoints included
    assert torch.equal(encode_e2m1(x), value_to_code(ref_round_e2m1(x)))


# ----------------------------------------------------------------------------------------------------
# packing


def test_pack_low_nibble_is_even_index():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x8, 0x7]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x0F, 0x78]]


def test_pack_unpack_bit_exact(gen):
    codes = torch.randint(0, 16, (3, 5, 64), generator=gen, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    c = codes.tolist()
    want = [[[c[b][r][2 * i] | (c[b][r][2 * i + 1] << 4) for i in range(32)] for r in range(5)] for b in range(3)]
    assert packed.tolist() == want
    assert torch.equal(unpack_fp4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)


def test_pack_odd_length_raises():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(4, 7, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------
# quantize / dequantize


def test_gaussian_error_bounds(gen):
    w = torch.randn(4, 96, 512, generator=gen) * torch.rand(4, 96, 1, generator=gen).add(0.1)
    q = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q)
    rel = ((deq - w).norm() / w.norm()).item()
    assert rel < TOL["gaussian_rel_error"], rel

    # Per element: at most half the gap between the two e2m1 magnitudes around |w| / (scale * global).
    step = q.block_scale.double().repeat_interleave(16, dim=-1) * q.global_scale.double()[:, None, None]
    v = w.double().abs() / step
    mags = torch.tensor(MAGNITUDES, dtype=torch.float64)
    hi_idx = torch.searchsorted(mags, v.clamp(max=6.0)).clamp(1, 7)
    gap = mags[hi_idx] - mags[hi_idx - 1]
    err = (deq.double() - w.double()).abs()
    bound = step * gap / 2 * (1 + TOL["half_step_rel_slack"])
    assert bool((err <= bound).all()), (err / bound).max().item()
    # The block scale never lets a block overflow the grid by more than e4m3 rounding (2^-4 relative).
    assert v.max().item() <= 6.0 * (1 + 2**-4) / (1 - 2**-4)


def test_default_global_scale_is_modelopt(gen):
    w = torch.randn(3, 32, 64, generator=gen)
    q = quantize_nvfp4(w)
    want = w.abs().amax(dim=(-2, -1)) / (6.0 * 448.0)
    assert q.global_scale.dtype == torch.float32
    assert torch.equal(q.global_scale, want)
    assert torch.equal(global_scale_for(w, batch_dims=1), want)


@settings(max_examples=60)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.sampled_from([(), (1,), (3,), (2, 2)]),
    n=st.integers(1, 6),
    blocks=st.integers(1, 3),
    global_scale=st.floats(min_value=2.0**-20, max_value=2.0**7, width=32),
    input_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_round_trip_of_grid_values_is_exact(seed, batch, n, blocks, global_scale, input_dtype):
    gen = torch.Generator().manual_seed(seed)
    k = 16 * blocks
    codes, scales = grid_tensor(gen, batch, n, k)
    gs = torch.full(batch, global_scale, dtype=torch.float32)
    q = NVFP4Tensor(pack_fp4(codes), scales, gs)
    w = dequantize_nvfp4(q)
    block_scales = scales.float().repeat_interleave(16, -1)
    assert torch.equal(w, torch.tensor(CODE_VALUES)[codes.long()] * block_scales * gs[..., None, None])
    q2 = quantize_nvfp4(w.to(input_dtype), gs)
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(q2.global_scale, gs)
    assert torch.equal(dequantize_nvfp4(q2), w)


def test_zero_blocks_and_all_zero_tensor(gen):
    w = torch.randn(2, 4, 64, generator=gen)
    w[0, 1, 16:32] = 0.0  # one zero block
    w[1] = 0.0  # an all-zero expert
    q = quantize_nvfp4(w)
    assert q.block_scale[0, 1, 1].float().item() == 1.0
    assert bool((unpack_fp4(q.packed)[0, 1, 16:32] == 0).all())
    assert q.global_scale[1].item() > 0 and math.isfinite(q.global_scale[1].item())
    assert bool((q.block_scale[1].float() == 1.0).all())
    assert torch.equal(dequantize_nvfp4(q)[1], torch.zeros(4, 64))

    z = quantize_nvfp4(torch.zeros(8, 32))
    assert z.global_scale.item() > 0 and math.isfinite(z.global_scale.item())
    assert bool((z.block_scale.float() == 1.0).all()) and bool((z.packed == 0).all())
    assert torch.equal(dequantize_nvfp4(z), torch.zeros(8, 32))


def test_batched_equals_per_expert(gen):
    w = torch.randn(5, 48, 96, generator=gen) * torch.logspace(-3, 2, 5)[:, None, None]
    q = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q)
    for e in range(5):
        qe = quantize_nvfp4(w[e])
        assert torch.equal(q.packed[e], qe.packed)
        assert torch.equal(q.block_scale[e].view(torch.uint8), qe.block_scale.view(torch.uint8))
        assert torch.equal(q.global_scale[e], qe.global_scale)
        assert torch.equal(deq[e], dequantize_nvfp4(qe))


def test_segments_keep_gate_and_up_exact(gen):
    e, inter, k = 3, 8, 64
    codes, scales = grid_tensor(gen, (e,), 2 * inter, k)
    scales[:, :, 0] = 448.0  # each half's amax is then 6 * 448 * its global scale, so the default recovers it
    scales[0, 0, 1] = 2.0**-6  # a small gate scale that a shared global scale would flush
    gate_gs = 2.0 ** torch.randint(-12, -6, (e,), generator=gen).float()
    up_gs = 2.0 ** torch.randint(0, 4, (e,), generator=gen).float()
    gs = torch.stack((gate_gs, up_gs), dim=-1)  # [E, 2]
    w = dequantize_nvfp4(NVFP4Tensor(pack_fp4(codes), scales, gs))

    q = quantize_nvfp4(w, segments=2)
    assert q.global_scale.shape == (e, 2)
    assert torch.equal(q.global_scale, gs)
    assert torch.equal(q.packed, pack_fp4(codes))
    assert torch.equal(q.block_scale.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(q), w)
    for half in range(2):
        rows = slice(half * inter, (half + 1) * inter)
        qh = quantize_nvfp4(w[:, rows])
        assert torch.equal(qh.packed, q.packed[:, rows])
        assert torch.equal(qh.global_scale, q.global_scale[:, half])
    # One global scale per expert cannot hold both halves exactly: the point of segments.
    assert not torch.equal(dequantize_nvfp4(quantize_nvfp4(w)), w)


@pytest.mark.parametrize("k", [1, 8, 24, 40])
def test_k_not_multiple_of_16_raises(k):
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, k))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="segments"):
        quantize_nvfp4(torch.randn(3, 32), segments=2)
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        quantize_nvfp4(torch.randn(32))
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(torch.randn(2, 4, 32), torch.ones(3))


def ref_fake_quant_activations(x: torch.Tensor, gs: float) -> torch.Tensor:
    """The activation recipe written out in float32: scale = e4m3(min(amax / (6 g), 448)), 1 where 0."""
    g = torch.tensor(gs, dtype=torch.float32)
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    s = (blocks.abs().amax(-1) / (6.0 * g)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = ref_round_e2m1(blocks / (s * g).unsqueeze(-1)).float()
    return (v * s.unsqueeze(-1) * g).reshape(x.shape)


@pytest.mark.parametrize("scalar_shape", [(), (1,)], ids=["0-dim", "[1]"])
def test_activation_quantization_with_given_input_scale(gen, scalar_shape):
    x = torch.randn(7, 128, generator=gen) * 3
    amax = x.abs().max().item()
    x[2, :16] *= 50.0  # past the calibrated range: must saturate, not rescale
    input_scale = torch.tensor(amax / (6 * 448), dtype=torch.float32).reshape(scalar_shape)
    q = quantize_activations_nvfp4(x, input_scale)
    assert q.global_scale.shape == () and q.global_scale.item() == input_scale.item()
    got = dequantize_nvfp4(q)
    assert torch.equal(got, ref_fake_quant_activations(x, input_scale.item()))
    assert q.block_scale[2, 0].float().item() == 448.0
    assert got[2, :16].abs().max().item() == pytest.approx(6 * 448 * input_scale.item(), rel=1e-6)
    # A different input scale changes the block scales: the given scale is used, not a fresh amax.
    q2 = quantize_activations_nvfp4(x, input_scale * 4)
    assert not torch.equal(q2.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(q2), ref_fake_quant_activations(x, input_scale.item() * 4))


def test_activation_quantization_batched(gen):
    x = torch.randn(2, 5, 64, generator=gen)
    s = torch.tensor(0.001)
    q = quantize_activations_nvfp4(x, s)
    assert q.global_scale.shape == (2,)
    assert torch.equal(dequantize_nvfp4(q), ref_fake_quant_activations(x, 0.001))


def test_nvfp4_tensor_properties(gen):
    q = quantize_nvfp4(torch.randn(3, 40, 64, generator=gen))
    assert (q.n, q.k, tuple(q.batch_shape)) == (40, 64, (3,))
    assert q.nbytes() == 3 * 40 * 32 + 3 * 40 * 4 + 3 * 4
    assert NVFP4.block_size == 16 and NVFP4.scale_dtype == torch.float8_e4m3fn
