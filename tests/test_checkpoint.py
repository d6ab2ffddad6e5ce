"""Checkpoint conventions (ModelOpt, compressed-tensors) and validation errors.

Every validation failure must raise CheckpointError whose message names the tensor
(``<layer>.<suffix>``) and the expert: the caller's for per-expert tensors, the first bad one for
stacked ``[E, ...]`` tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_nvfp4.checkpoint import (
    CheckpointError,
    Convention,
    NVFP4Linear,
    detect_convention,
    from_checkpoint,
    to_checkpoint,
    validate_nvfp4,
)
from moe_nvfp4.formats import NVFP4Tensor, ScaleLayout, dequantize_nvfp4, quantize_nvfp4

# Tolerance bounds of this file.
TOL = {
    # Same-convention round trips move the stored tensors unchanged.
    "same_convention": 0.0,
    # compressed-tensors stores reciprocals; 1 / (1 / x) in float32 may be off by one ulp (2^-23 relative).
    "reciprocal_rel": 2.0**-23,
}

N, K = 48, 64
LAYER = "model.layers.3.mlp.experts.5.gate_proj"
EXPERT = 5
NAMES = {
    Convention.MODELOPT: {
        "packed": "weight",
        "scale": "weight_scale",
        "global": "weight_scale_2",
        "input": "input_scale",
    },
    Convention.COMPRESSED_TENSORS: {
        "packed": "weight_packed",
        "scale": "weight_scale",
        "global": "weight_global_scale",
        "input": "input_global_scale",
    },
}


def layer_tensors(gen: torch.Generator, convention: Convention, scalar_shape: tuple[int, ...] = ()) -> dict:
    """One layer's tensors as that convention stores them, from a fresh random weight."""
    q = quantize_nvfp4(torch.randn(N, K, generator=gen))
    input_scale = torch.rand((), generator=gen) * 0.01 + 1e-4
    names = NAMES[convention]
    reciprocal = convention is Convention.COMPRESSED_TENSORS
    gs = 1.0 / q.global_scale if reciprocal else q.global_scale
    ins = 1.0 / input_scale if reciprocal else input_scale
    return {
        names["packed"]: q.packed,
        names["scale"]: q.block_scale,
        names["global"]: gs.float().reshape(scalar_shape),
        names["input"]: ins.float().reshape(scalar_shape),
    }


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("scalar_shape", [(), (1,)], ids=["0-dim", "[1]"])
def test_modelopt_round_trip(gen, scalar_shape):
    tensors = layer_tensors(gen, Convention.MODELOPT, scalar_shape)
    assert detect_convention(tensors) is Convention.MODELOPT
    layer = from_checkpoint(tensors, name=LAYER, expert=EXPERT)
    assert layer.weight.global_scale.shape == () and layer.input_scale.shape == ()
    assert layer.weight.global_scale.item() == tensors["weight_scale_2"].item()
    assert layer.input_scale.item() == tensors["input_scale"].item()
    out = to_checkpoint(layer, Convention.MODELOPT)
    assert set(out) == set(tensors)
    for key, t in tensors.items():
        assert_same_tensor(out[key], t.reshape(()) if t.numel() == 1 else t)


@pytest.mark.parametrize("scalar_shape", [(), (1,)], ids=["0-dim", "[1]"])
def test_compressed_tensors_round_trip(gen, scalar_shape):
    tensors = layer_tensors(gen, Convention.COMPRESSED_TENSORS, scalar_shape)
    assert detect_convention(tensors) is Convention.COMPRESSED_TENSORS
    layer = from_checkpoint(tensors, name=LAYER, expert=EXPERT)
    # The loaded global and input scales are ModelOpt multipliers: the reciprocals of what CT stores.
    wgs, igs = tensors["weight_global_scale"].item(), tensors["input_global_scale"].item()
    assert layer.weight.global_scale.item() == pytest.approx(1.0 / wgs, rel=TOL["reciprocal_rel"])
    assert layer.input_scale.item() == pytest.approx(1.0 / igs, rel=TOL["reciprocal_rel"])
    out = to_checkpoint(layer, Convention.COMPRESSED_TENSORS)
    assert set(out) == set(tensors)
    assert_same_tensor(out["weight_packed"], tensors["weight_packed"])
    assert_same_tensor(out["weight_scale"], tensors["weight_scale"])
    for key in ("weight_global_scale", "input_global_scale"):
        assert out[key].shape == () and out[key].dtype == torch.float32
        assert out[key].item() == pytest.approx(tensors[key].item(), rel=TOL["reciprocal_rel"])


def test_conventions_describe_the_same_weight(gen):
    mo = layer_tensors(gen, Convention.MODELOPT)
    from_mo = from_checkpoint(mo)
    ct = to_checkpoint(from_mo, Convention.COMPRESSED_TENSORS)
    rel = TOL["reciprocal_rel"]
    assert ct["weight_global_scale"].item() == pytest.approx(1.0 / mo["weight_scale_2"].item(), rel=rel)
    assert ct["input_global_scale"].item() == pytest.approx(1.0 / mo["input_scale"].item(), rel=rel)
    from_ct = from_checkpoint(ct)
    torch.testing.assert_close(
        dequantize_nvfp4(from_ct.weight), dequantize_nvfp4(from_mo.weight), rtol=2 * TOL["reciprocal_rel"], atol=0
    )
    # A power-of-two scale survives the reciprocal exactly.
    mo["weight_scale_2"] = torch.tensor(2.0**-9)
    ct = to_checkpoint(from_checkpoint(mo), Convention.COMPRESSED_TENSORS)
    assert ct["weight_global_scale"].item() == 512.0
    assert to_checkpoint(from_checkpoint(ct))["weight_scale_2"].item() == 2.0**-9


def test_input_scale_is_optional_and_swizzled_scales_are_written_linear(gen):
    tensors = layer_tensors(gen, Convention.MODELOPT)
    del tensors["input_scale"]
    layer = from_checkpoint(tensors)
    assert layer.input_scale is None
    swizzled = NVFP4Linear(layer.weight.swizzled_scales())
    out = to_checkpoint(swizzled)
    assert set(out) == {"weight", "weight_scale", "weight_scale_2"}
    assert_same_tensor(out["weight_scale"], tensors["weight_scale"])


def test_not_an_nvfp4_layer():
    with pytest.raises(CheckpointError, match="not an NVFP4 layer"):
        detect_convention({"weight": torch.zeros(2, 2)})


# ----------------------------------------------------------------------------------------------------
# Validation errors of one expert's tensors: (why, which tensor is blamed, how to break the set).


def _set(role, value):
    return lambda t, names: t.__setitem__(names[role], value(t[names[role]]))


def _delete(role):
    return lambda t, names: t.pop(names[role])


def _nan_block_scale(byte):
    def mutate(t, names):
        s = t[names["scale"]].view(torch.uint8).clone()
        s[N // 2, 1] = byte
        t[names["scale"]] = s.view(torch.float8_e4m3fn)

    return mutate


def _transpose(s):
    return s.view(torch.uint8).T.contiguous().view(torch.float8_e4m3fn)


def _shrink_k(t, names):  # K = 8: a consistent [N, 4] packed / [N, 0] scale pair, but not 16-aligned
    t[names["packed"]] = t[names["packed"]][:, :4]
    t[names["scale"]] = t[names["scale"]][:, :0]


ERROR_CASES = {
    "packed_wrong_dtype": ("packed", _set("packed", lambda p: p.view(torch.int8)), "dtype"),
    "packed_as_float": ("packed", _set("packed", lambda p: p.float()), "dtype"),
    "packed_1d": ("packed", _set("packed", lambda p: p.flatten()), "shape"),
    "scale_wrong_dtype": ("scale", _set("scale", lambda s: s.float()), "dtype"),
    "scale_wrong_shape": ("scale", _set("scale", lambda s: s[:, :-1]), "shape"),
    "scale_transposed": ("scale", _set("scale", _transpose), "shape"),
    "k_not_multiple_of_16": ("packed", _shrink_k, "multiple of 16"),
    "global_int": ("global", _set("global", lambda g: torch.tensor(1, dtype=torch.int32)), "floating-point"),
    "global_not_scalar": ("global", _set("global", lambda g: g.reshape(1).repeat(2)), "scalar"),
    "global_nan": ("global", _set("global", lambda g: torch.tensor(math.nan)), "finite and positive"),
    "global_inf": ("global", _set("global", lambda g: torch.tensor(math.inf)), "finite and positive"),
    "global_zero": ("global", _set("global", lambda g: torch.tensor(0.0)), "finite and positive"),
    "global_negative": ("global", _set("global", lambda g: -g), "finite and positive"),
    "input_nan": ("input", _set("input", lambda g: torch.tensor([math.nan])), "finite and positive"),
    "input_zero": ("input", _set("input", lambda g: torch.tensor(0.0)), "finite and positive"),
    "input_negative": ("input", _set("input", lambda g: -g), "finite and positive"),
    # e4m3fn has no inf (a cast saturates to 448); its NaNs are 0x7F and 0xFF.
    "block_scale_nan": ("scale", _nan_block_scale(0x7F), "NaN or inf"),
    "block_scale_negative_nan": ("scale", _nan_block_scale(0xFF), "NaN or inf"),
    "block_scale_negative": ("scale", _nan_block_scale(0xB8), "negative"),  # 0xB8 = -1.0
    "missing_packed": ("packed", _delete("packed"), "missing"),
    "missing_scale": ("scale", _delete("scale"), "missing"),
    "missing_global": ("global", _delete("global"), "missing"),
}


@pytest.mark.parametrize("convention", list(Convention), ids=[c.value for c in Convention])
@pytest.mark.parametrize("role, mutate, problem", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_validation_error_names_tensor_and_expert(gen, convention, role, mutate, problem):
    names = NAMES[convention]
    tensors = layer_tensors(gen, convention)
    from_checkpoint(tensors, convention, name=LAYER, expert=EXPERT)  # the untouched set is valid
    mutate(tensors, names)
    with pytest.raises(CheckpointError) as info:
        from_checkpoint(tensors, convention, name=LAYER, expert=EXPERT)
    message = str(info.value)
    assert f"{LAYER}.{names[role]} (expert {EXPERT}):" in message
    assert problem in message


def test_inf_cannot_hide_in_e4m3_block_scales():
    """Why the inf case above is a NaN case: e4m3fn saturates inf to its largest finite value."""
    assert torch.tensor([math.inf]).to(torch.float8_e4m3fn).float().item() == 448.0


def test_expected_shape_mismatch_names_tensor(gen):
    q = quantize_nvfp4(torch.randn(N, K, generator=gen))
    validate_nvfp4(q, name=LAYER, expert=EXPERT, expected_shape=(N, K))
    with pytest.raises(CheckpointError, match=rf"{LAYER}\.weight \(expert {EXPERT}\): .*expected \({N}, {2 * K}\)"):
        validate_nvfp4(q, name=LAYER, expert=EXPERT, expected_shape=(N, 2 * K))


def test_message_without_expert_has_no_expert(gen):
    tensors = layer_tensors(gen, Convention.MODELOPT)
    tensors["weight_scale_2"] = torch.tensor(-1.0)
    with pytest.raises(CheckpointError, match=r"^layer\.weight_scale_2: ") as info:
        from_checkpoint(tensors)
    assert "expert" not in str(info.value)


# ----------------------------------------------------------------------------------------------------
# Stacked [E, ...] tensors name the first bad expert.

E = 7


def stacked(gen: torch.Generator, segments: int = 1) -> NVFP4Tensor:
    return quantize_nvfp4(torch.randn(E, N, K, generator=gen), segments=segments)


def with_block_bytes(q: NVFP4Tensor, fill: dict[int, int]) -> NVFP4Tensor:
    s = q.block_scale.view(torch.uint8).clone()
    for e, byte in fill.items():
        s[e, N - 1, -1] = byte
    return NVFP4Tensor(q.packed, s.view(torch.float8_e4m3fn), q.global_scale, q.scale_layout)


def with_global(q: NVFP4Tensor, gs: torch.Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(q.packed, q.block_scale, gs, q.scale_layout)


def test_valid_stacked_tensors_pass(gen):
    q = stacked(gen)
    validate_nvfp4(q, expected_shape=(N, K))
    validate_nvfp4(q.swizzled_scales(), expected_shape=(N, K))
    validate_nvfp4(stacked(gen, segments=2))


@pytest.mark.parametrize("first_bad", [0, 2, E - 1])
def test_stacked_block_scale_errors_name_first_bad_expert(gen, first_bad):
    q = stacked(gen)
    later = sorted({first_bad, E - 1})[-1]
    for byte, problem in [(0x7F, "NaN or inf"), (0xFF, "NaN or inf"), (0xC0, "negative")]:
        bad = with_block_bytes(q, {first_bad: byte, later: byte})
        with pytest.raises(CheckpointError, match=rf"^w13\.weight_scale \(expert {first_bad}\): .*{problem}"):
            validate_nvfp4(bad, name="w13")


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_stacked_global_scale_errors_name_first_bad_expert(gen, value):
    q = stacked(gen)
    gs = q.global_scale.clone()
    gs[3] = value
    gs[5] = value
    with pytest.raises(CheckpointError, match=r"^w2\.weight_scale_2 \(expert 3\): .*finite and positive"):
        validate_nvfp4(with_global(q, gs), name="w2")
    q2 = stacked(gen, segments=2)
    gs2 = q2.global_scale.clone()
    gs2[4, 1] = value  # the up half of expert 4
    with pytest.raises(CheckpointError, match=r"^w13\.weight_scale_2 \(expert 4\): "):
        validate_nvfp4(with_global(q2, gs2), name="w13")


def test_stacked_shape_and_dtype_errors_name_tensor(gen):
    q = stacked(gen)
    cases = [
        (NVFP4Tensor(q.packed.view(torch.int8), q.block_scale, q.global_scale), "w13.weight: dtype"),
        (NVFP4Tensor(q.packed, q.block_scale.float(), q.global_scale), "w13.weight_scale: dtype"),
        (NVFP4Tensor(q.packed, q.block_scale, q.global_scale.int()), "w13.weight_scale_2: dtype"),
        (NVFP4Tensor(q.packed, q.block_scale[:-1], q.global_scale), "w13.weight_scale: shape"),
        (NVFP4Tensor(q.packed, q.block_scale, q.global_scale[:-1]), "w13.weight_scale_2: shape"),
        (NVFP4Tensor(q.packed, q.block_scale, q.global_scale, ScaleLayout.SWIZZLED_128x4), "w13.weight_scale: shape"),
        (NVFP4Tensor(q.packed[..., :4], q.block_scale[..., :0], q.global_scale), "w13.weight: K=8"),
    ]
    for bad, start in cases:
        with pytest.raises(CheckpointError) as info:
            validate_nvfp4(bad, name="w13")
        assert str(info.value).startswith(start), str(info.value)
