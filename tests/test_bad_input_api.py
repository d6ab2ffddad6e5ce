"""Bad input at the public API (issue 54): each case is a clear ValueError/TypeError naming the argument, tensor or
field, or correct output; never a silent wrong answer.

Tolerances, ||out - ref|| / ||ref||:
  STRIDED_REL_TOL 2e-3  Triton kernels (interpreter, fp16) against the float64 reference on contiguous copies of
                        the same routing: the roundings of x, the SiLU*up intermediate and the output to fp16, as in
                        tests/test_kernel_interpreter.py.
  exact                 CPU paths (the torch reference) with strided routing against contiguous routing, and the
                        Triton quantizer's bytes against the reference's for NaN/inf blocks and unusable scales.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.formats import INPUT_SCALE_RANGE, unpack_fp4
from moe_nvfp4.weight_layouts import Sm100Layout

STRIDED_REL_TOL = 2e-3
E, H, I, K = 4, 64, 32, 2


def _layer(gen: torch.Generator, e: int = E, h: int = H, i: int = I) -> tuple[m.NVFP4Tensor, m.NVFP4Tensor]:
    w13 = m.quantize_nvfp4(torch.randn(e, 2 * i, h, generator=gen) / h**0.5, segments=2)
    w2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) / i**0.5)
    return w13, w2


def _routing(gen: torch.Generator, t: int, e: int = E, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    return m.topk_softmax(torch.randn(t, e, generator=gen), k, renormalize=True)


def _strided_views(tw: torch.Tensor, ti: torch.Tensor, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, ...]]:
    """Routing as strided views: the first column of top-k routing (``[:, :1]``, whose flat view keeps a stride of
    k), the first k columns of a wider buffer (int64 ids), every other row of a taller one, a column slice in the
    middle, and strided ids beside contiguous weights."""
    t, k = ti.shape
    wide_w, wide_i = torch.rand(t, k + 3, generator=gen), torch.randint(0, E, (t, k + 3), generator=gen)
    wide_w[:, :k], wide_i[:, :k] = tw, ti
    tall_w, tall_i = torch.rand(2 * t, k, generator=gen), torch.randint(0, E, (2 * t, k), generator=gen).int()
    tall_w[::2], tall_i[::2] = tw, ti
    mid_w, mid_i = torch.rand(t, k + 2, generator=gen), torch.randint(0, E, (t, k + 2), generator=gen).int()
    mid_w[:, 1 : k + 1], mid_i[:, 1 : k + 1] = tw, ti
    return {
        "[:, :1] of top-k routing": (tw[:, :1], ti[:, :1]),
        "first columns of a wider buffer (int64 ids)": (wide_w[:, :k], wide_i[:, :k]),
        "every other row": (tall_w[::2], tall_i[::2]),
        "a column slice in the middle": (mid_w[:, 1 : k + 1], mid_i[:, 1 : k + 1]),
        "strided ids, contiguous weights": (tw[:, :1].contiguous(), wide_i[:, :1]),
    }


def test_strided_routing_on_cpu_equals_contiguous(gen: torch.Generator) -> None:
    """Both MoE entries (the reference on CPU) give exactly the output of the same routing made contiguous."""
    w13, w2 = _layer(gen)
    weights, w4a4 = m.prepare_moe_weights(w13, w2), m.prepare_moe_weights_w4a4(w13, w2)
    x = torch.randn(5, H, generator=gen).bfloat16()
    scale = torch.tensor([0.01])
    for why, (sw, si) in _strided_views(*_routing(gen, 5), gen).items():
        assert not si.is_contiguous(), why
        cw, ci = sw.contiguous(), si.contiguous()
        assert torch.equal(m.fused_moe(x, weights, sw, si), m.fused_moe(x, weights, cw, ci)), why
        assert torch.equal(
            m.fused_moe_w4a4(x, w4a4, sw, si, w13_input_scale=scale, w2_input_scale=scale),
            m.fused_moe_w4a4(x, w4a4, cw, ci, w13_input_scale=scale, w2_input_scale=scale),
        ), why


# Runs in a subprocess so TRITON_INTERPRET is set before triton is imported.
STRIDED_SCRIPT = textwrap.dedent(
    """
    import sys, torch, moe_nvfp4 as m
    sys.path.insert(0, sys.argv[2])
    from test_bad_input_api import E, H, I, _layer, _routing, _strided_views
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    w13, w2 = _layer(g)
    weights = m.prepare_moe_weights(w13, w2)
    x = torch.randn(7, H, generator=g).half()
    tw, ti = _routing(g, 7)
    ti[0, 0] = -5  # an out-of-range id: contributes nothing, strided or not
    for why, (sw, si) in _strided_views(tw, ti, g).items():
        out = m.fused_moe(x, weights, sw, si)
        ref = m.fused_moe_torch(x, w13, w2, sw.contiguous(), si.contiguous(), compute_dtype=torch.float64)
        print(why, ((out.double() - ref).norm() / ref.norm()).item())
    """
)


@pytest.mark.slow
def test_strided_routing_through_the_triton_kernels(seed: int) -> None:
    """The Triton path (interpreter) reads routing views as their values, not as the bytes of a contiguous
    tensor (before the fix: 0.35-1.33 relative error)."""
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton")
    proc = subprocess.run(
        [sys.executable, "-c", STRIDED_SCRIPT, str(seed % 2**31), os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 5, proc.stdout
    for line in lines:
        why, rel = line.rsplit(" ", 1)
        assert float(rel) < STRIDED_REL_TOL, why


def _weights(gen: torch.Generator) -> m.MoEWeights:
    return m.prepare_moe_weights(*_layer(gen))


METADATA_CASES = [  # (fields replaced, what the error must say)
    (dict(intermediate=128), r"MoEWeights\.w13_packed must be torch\.uint8 \(4, 256, 64\)"),
    (dict(hidden=256), r"MoEWeights\.w13_packed must be .* hidden=256"),
    (dict(hidden=0), r"MoEWeights\.hidden must be a positive multiple of 16, got 0"),
    (dict(intermediate=40), r"MoEWeights\.intermediate must be a positive multiple of 16"),
    (dict(intermediate=32.0), r"MoEWeights\.intermediate must be a positive multiple of 16"),
    (dict(activation=m.RELU2), r"MoEWeights\.w13_packed must be .* \(relu2\)"),
    (dict(layout=Sm100Layout()), r"MoEWeights\.w13_packed must be .* sm100_interleaved"),
    (dict(layout="sm90_fragments"), r"MoEWeights\.layout must be"),
    (dict(activation="silu"), r"MoEWeights\.activation must be"),
    (dict(w2_global=torch.ones(4, 2)), r"MoEWeights\.w2_global must be torch\.float32 \(4,\)"),
    (dict(w13_global=torch.ones(4, 2, dtype=torch.float64)), r"MoEWeights\.w13_global must be torch\.float32"),
    (dict(w2_packed=torch.zeros(4, 64, 64, dtype=torch.int8)), r"MoEWeights\.w2_packed must be torch\.uint8"),
    (
        dict(w2_packed=torch.zeros(4, 64, 128, dtype=torch.uint8)[:, :, ::2]),
        r"MoEWeights\.w2_packed must be contiguous",
    ),
    (dict(w2_scale=torch.zeros(4, 64, 8, dtype=torch.uint8, device="meta")), r"MoEWeights\.w2_scale is on meta"),
    (dict(w13_bias=torch.zeros(4, 32)), r"MoEWeights\.w13_bias must be torch\.float32 \(4, 64\)"),
    (dict(w2_bias=torch.zeros(4, 64, dtype=torch.float16)), r"MoEWeights\.w2_bias must be torch\.float32"),
    (dict(w13_packed=torch.zeros(0, 128, 32, dtype=torch.uint8)), r"holds no experts"),
    (dict(w13_packed=torch.zeros(128, 32, dtype=torch.uint8)), r"MoEWeights\.w13_packed must be a \[E, rows, K/2\]"),
]


@pytest.mark.parametrize(
    "change,match", METADATA_CASES, ids=[f"{i}-{','.join(c)}" for i, (c, _) in enumerate(METADATA_CASES)]
)
def test_weights_metadata_is_checked_against_the_tensors(change: dict, match: str, gen: torch.Generator) -> None:
    """dataclasses.replace and the public constructor both reach __post_init__: sizes, dtypes, devices and
    contiguity that disagree with the tensors are refused, naming the field (before: the kernels read past the
    buffers, non-finite or changing output)."""
    weights = _weights(gen)
    with pytest.raises((ValueError, TypeError), match=match):
        dataclasses.replace(weights, **change)
    with pytest.raises((ValueError, TypeError), match=match):
        m.MoEWeights(**{f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)} | change)


def test_weights_in_a_w4a4_layout_run_silu_without_biases(gen: torch.Generator) -> None:
    w4a4 = m.prepare_moe_weights_w4a4(*_layer(gen))
    with pytest.raises(ValueError, match="sm100_interleaved layout .* gated SiLU without biases"):
        dataclasses.replace(w4a4, w2_bias=torch.zeros(E, H))
    with pytest.raises(ValueError, match="sm100_interleaved layout .* got activation swiglu_oai"):
        dataclasses.replace(w4a4, activation=m.SWIGLU_OAI)
    weights = _weights(gen)
    assert dataclasses.replace(weights, w2_bias=torch.zeros(E, H)).w2_bias is not None  # valid: accepted


def test_prepare_refuses_meta_mixed_devices_empty_sizes_and_wrong_types(gen: torch.Generator) -> None:
    w13, w2 = _layer(gen)
    with pytest.raises(ValueError, match="w13 is on the meta device"):
        m.prepare_moe_weights(w13.to("meta"), w2.to("meta"))
    with pytest.raises(ValueError, match="w2 is on the meta device"):
        m.prepare_moe_weights(w13, w2.to("meta"))
    mixed = m.NVFP4Tensor(w2.packed, w2.block_scale, w2.global_scale.to("meta"))
    with pytest.raises(ValueError, match="w2 is on the meta device"):
        m.prepare_moe_weights(w13, mixed)
    for h, i in ((0, I), (H, 0)):
        q13 = m.quantize_nvfp4(torch.randn(E, 2 * i, h, generator=gen), segments=2)
        q2 = m.quantize_nvfp4(torch.randn(E, h, i, generator=gen))
        with pytest.raises(ValueError, match=f"hidden size H={h} and intermediate size I={i} .* positive multiples"):
            m.prepare_moe_weights(q13, q2)
    with pytest.raises(TypeError, match="w13 must be an NVFP4Tensor, got Tensor"):
        m.prepare_moe_weights(torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), w2)


def _operand(gen: torch.Generator, rows: int, k: int) -> m.NVFP4Tensor:
    return m.quantize_nvfp4(torch.randn(rows, k, generator=gen))


def test_grouped_gemm_refuses_wrong_scale_shapes(gen: torch.Generator) -> None:
    """A block-scale tensor with fewer rows than its operand: the swizzle padded it to the same shape, and the rows
    past it came back zero.  Checked per layout, on both entries."""
    a, b = _operand(gen, 8, 64), _operand(gen, 24, 64)
    short = m.NVFP4Tensor(a.packed, a.block_scale[:4], a.global_scale)
    narrow = m.NVFP4Tensor(b.packed, b.block_scale[:, :2], b.global_scale)
    swizzled = a.swizzled_scales()
    wrong_swizzle = m.NVFP4Tensor(a.packed, swizzled.block_scale[:, :2], a.global_scale, m.ScaleLayout.SWIZZLED_128x4)
    for args, match in (
        (([short], [b]), r"group 0: A\.block_scale \(linear\) must be \(8, 4\) for a \[8, 64\] operand, got \(4, 4\)"),
        (([a, a], [b, narrow]), r"group 1: B\.block_scale \(linear\) must be \(24, 4\)"),
        (([wrong_swizzle], [b]), r"group 0: A\.block_scale \(swizzled_128x4\) must be \(128, 4\)"),
    ):
        for entry in (m.grouped_gemm_nvfp4, m.plan_grouped_gemm_nvfp4):
            with pytest.raises(ValueError, match=match):
                entry(*args)
    assert m.grouped_gemm_nvfp4([swizzled], [b])[0].shape == (8, 24)  # the right swizzled shape is accepted


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_grouped_gemm_refuses_unusable_global_scales(value: float, gen: torch.Generator) -> None:
    """A global scale of 0 gave all zeros, a negative one a flipped sign."""
    a, b = _operand(gen, 8, 64), _operand(gen, 16, 64)
    bad = m.NVFP4Tensor(b.packed, b.block_scale, torch.tensor(value))
    for entry in (m.grouped_gemm_nvfp4, m.plan_grouped_gemm_nvfp4):
        with pytest.raises(ValueError, match=r"group 1: B\.global_scale must be finite and positive"):
            entry([a, a], [b, bad])


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0xB8], ids=["NaN", "-NaN", "-1.0"])
def test_grouped_gemm_refuses_nan_and_negative_block_scales(byte: int, gen: torch.Generator) -> None:
    """The Triton kernel reads a scale's magnitude bits only (NaN as 480, -s as s): refused, not misread.
    A NaN block scale is what quantize_activations gives a NaN block, so NaN activations are refused here."""
    a, b = _operand(gen, 8, 64), _operand(gen, 16, 64)
    scales = a.block_scale.view(torch.uint8).clone()
    scales[3, 2] = byte
    bad = m.NVFP4Tensor(a.packed, scales.view(m.NVFP4.scale_dtype), a.global_scale)
    for operand in (bad, bad.swizzled_scales()):
        with pytest.raises(ValueError, match=r"group 0: A\.block_scale holds NaN or negative e4m3 scales"):
            m.grouped_gemm_nvfp4([operand], [b])
    x = torch.randn(8, 64, generator=gen)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or negative"):
        m.grouped_gemm_nvfp4([m.quantize_activations(x, torch.tensor([0.01]))], [b])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_quantize_nvfp4_refuses_non_finite_weights(value: float, gen: torch.Generator) -> None:
    """NaN weights quantized to 0 (NVFP4 has no NaN code); inf saturated and zeroed its block."""
    w = torch.randn(3, 8, 32, generator=gen)
    w[1, 2, 7] = value
    with pytest.raises(ValueError, match=r"quantize_nvfp4: w has 1 NaN/inf values \(the first at \(1, 2, 7\)\)"):
        m.quantize_nvfp4(w)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_quantize_nvfp4_refuses_unusable_global_scales(value: float, gen: torch.Generator) -> None:
    w = torch.randn(3, 8, 32, generator=gen)
    gs = torch.full((3,), 0.01)
    gs[1] = value
    with pytest.raises(ValueError, match="quantize_nvfp4: global_scale must be finite and positive"):
        m.quantize_nvfp4(w, gs)
    with pytest.raises(ValueError, match="global_scale must be finite and positive"):
        m.quantize_nvfp4(w, torch.tensor(value))


@pytest.mark.parametrize("segments", [0, -1, 1.5, True, "2"])
def test_quantize_nvfp4_refuses_bad_segments(segments, gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match=f"segments must be an int >= 1, got {segments!r}"):
        m.quantize_nvfp4(torch.randn(4, 32, generator=gen), segments=segments)


def test_quantize_nvfp4_other_bad_arguments(gen: torch.Generator) -> None:
    with pytest.raises(TypeError, match="quantize_nvfp4: w must be a floating-point tensor, got torch.int32"):
        m.quantize_nvfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="global_scale must be a tensor, got float"):
        m.quantize_nvfp4(torch.randn(4, 32, generator=gen), 0.5)


def test_quantize_nvfp4_takes_a_0_dim_scale_for_every_batch_index(gen: torch.Generator) -> None:
    """A 0-dim global scale with batched weights (a raw crash before) is the scale of every batch index."""
    w = torch.randn(3, 8, 32, generator=gen)
    one = m.quantize_nvfp4(w, torch.tensor(0.004))
    each = m.quantize_nvfp4(w, torch.full((3,), 0.004))
    assert one.global_scale.shape == (3,)
    assert torch.equal(one.packed, each.packed) and torch.equal(one.global_scale, each.global_scale)
    assert torch.equal(one.block_scale.view(torch.uint8), each.block_scale.view(torch.uint8))


BAD_INPUT_SCALES = [0.0, -0.01, float("nan"), float("inf"), 1e-30, 1e30]


@pytest.mark.parametrize("value", BAD_INPUT_SCALES)
def test_w4a4_unusable_input_scale_gives_nan_output(value: float, gen: torch.Generator) -> None:
    """Per-call scales are checked on the device (no host synchronisation): outside INPUT_SCALE_RANGE the output
    is NaN, never zeros or a flipped sign (before: zeros or wrong output).  The edges of the range are usable."""
    w13, w2 = _layer(gen)
    w4a4 = m.prepare_moe_weights_w4a4(w13, w2)
    x = torch.randn(3, H, generator=gen).bfloat16()
    tw, ti = _routing(gen, 3)
    good = torch.tensor([0.01])
    for s13, s2 in ((torch.tensor([value]), good), (good, torch.tensor([value]))):
        out = m.fused_moe_w4a4(x, w4a4, tw, ti, w13_input_scale=s13, w2_input_scale=s2)
        assert out.isnan().all(), (s13, s2)
    for edge in INPUT_SCALE_RANGE:
        out = m.fused_moe_w4a4(x, w4a4, tw, ti, w13_input_scale=torch.tensor([edge]), w2_input_scale=good)
        assert not out.isnan().any(), edge


def test_w4a4_nan_token_gives_nan_like_w4a16(gen: torch.Generator) -> None:
    """A token holding NaN gets NaN output on both paths; the other tokens are unchanged (exact)."""
    w13, w2 = _layer(gen)
    weights, w4a4 = m.prepare_moe_weights(w13, w2), m.prepare_moe_weights_w4a4(w13, w2)
    x = torch.randn(4, H, generator=gen).bfloat16()
    tw, ti = _routing(gen, 4)
    scale = torch.tensor([0.01])
    clean = (
        m.fused_moe(x, weights, tw, ti),
        m.fused_moe_w4a4(x, w4a4, tw, ti, w13_input_scale=scale, w2_input_scale=scale),
    )
    x[1, 7] = float("nan")
    poisoned = (
        m.fused_moe(x, weights, tw, ti),
        m.fused_moe_w4a4(x, w4a4, tw, ti, w13_input_scale=scale, w2_input_scale=scale),
    )
    for before, after in zip(clean, poisoned):
        assert after[1].isnan().all()
        rest = [0, 2, 3]
        assert torch.equal(after[rest], before[rest])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_quantize_activations_propagates_non_finite_blocks(value: float, gen: torch.Generator) -> None:
    """Only the block holding NaN or inf dequantizes to NaN (before: NaN became a finite value)."""
    x = torch.randn(5, 64, generator=gen)
    x[3, 20] = value
    q = m.quantize_activations(x, torch.tensor([0.01]))
    back = m.dequantize_nvfp4(q)
    assert back[3, 16:32].isnan().all() and back.isnan().sum() == 16
    assert q.linear_scales().block_scale.view(torch.uint8)[3, 1] == 0x7F
    assert (unpack_fp4(q.packed)[3, 16:32] == 0).all()


@pytest.mark.parametrize("value", BAD_INPUT_SCALES)
def test_quantize_activations_unusable_scale_gives_nan(value: float, gen: torch.Generator) -> None:
    x = torch.randn(5, 64, generator=gen)
    q = m.quantize_activations(x, torch.tensor([value]))
    assert q.global_scale.isnan() and m.dequantize_nvfp4(q).isnan().all()
    assert m.dequantize_nvfp4(m.quantize_activations_nvfp4(x, torch.tensor(value))).isnan().all()  # the twin too


QUANT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, moe_nvfp4 as m
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    x = torch.randn(37, 80, generator=g)
    x[1, 3], x[2, 20], x[3, 79], x[4, :16] = float("nan"), float("inf"), -float("inf"), float("nan")
    for value in (0.01, 0.0, float("nan"), -1.0, 1e-30):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gs = torch.tensor([value])
            got = m.quantize_activations(x.to(dtype), gs)
            ref = m.quantize_activations_nvfp4(x.to(dtype), gs).swizzled_scales()
            same = torch.equal(got.packed, ref.packed) and torch.equal(got.block_scale.view(torch.uint8),
                                                                       ref.block_scale.view(torch.uint8))
            nan_rows = m.dequantize_nvfp4(got).isnan().any(1).nonzero().flatten().tolist()
            print(value, dtype, same, nan_rows == ([1, 2, 3, 4] if value == 0.01 else list(range(37))))
    """
)


@pytest.mark.slow
def test_triton_quantizer_propagates_nan_with_the_reference_bytes(seed: int) -> None:
    """The Triton quantizer (interpreter) gives the reference's bytes for NaN/inf blocks (scale byte 0x7F, codes 0)
    and for unusable global scales (every block NaN), in every input dtype."""
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", QUANT_SCRIPT, str(seed % 2**31)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 15 and all(line.endswith("True True") for line in lines), proc.stdout
