"""Expert-MLP variants on CPU (issue 42): the activations of ``expert_activation`` (gated SiLU, gpt-oss's clamped
SwiGLU, non-gated ReLU^2), per-expert biases on both GEMMs, and the router weight applied to the input.

Hand-computed cases run ``moe_dense_torch`` on float weights small enough to follow by hand; properties run
``fused_moe_torch`` on random NVFP4 layers (full FP4 code range); the API tests check packing, validation and
that the CPU ``fused_moe`` (the custom op) is the reference.  Bounds: hand cases 1e-6 relative (float32 math,
float64 expectation); identities between two reference runs 1e-5 of the output's scale (float32 summation
order); the CPU op equals the reference exactly (same function).
"""

from __future__ import annotations

import math

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.expert_activation import ACTIVATION_NAMES
from moe_nvfp4.reference import moe_dense_torch

HAND_TOL = 1e-6
IDENTITY_TOL = 1e-5
VARIANTS = [m.SILU, m.SWIGLU_OAI, m.RELU2]


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def _hand_moe(x: list[float], w13: list[list[float]], w2: list[list[float]], weight: float = 1.0, **kw) -> torch.Tensor:
    """One expert, one token, top-1 at ``weight``: moe_dense_torch on float32 weights."""
    out = moe_dense_torch(
        torch.tensor([x]),
        torch.tensor([w13]),
        torch.tensor([w2]),
        torch.tensor([[weight]]),
        torch.zeros(1, 1, dtype=torch.int32),
        **kw,
    )
    return out[0].double()


def _close(got: torch.Tensor, want: list[float]) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    assert (got - want_t).abs().max() <= HAND_TOL * want_t.abs().max(), (got, want_t)


def test_activation_is_validated_data() -> None:
    assert [a.name for a in VARIANTS] == list(ACTIVATION_NAMES)
    assert (m.SILU.gated, m.SWIGLU_OAI.gated, m.RELU2.gated) == (True, True, False)
    assert (m.SWIGLU_OAI.alpha, m.SWIGLU_OAI.limit) == (1.702, 7.0)  # vLLM's SwigluOAIAndMul defaults
    with pytest.raises(ValueError, match="silu, swiglu_oai, relu2"):
        m.ExpertActivation("gelu")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            m.ExpertActivation("swiglu_oai", alpha=bad)
        with pytest.raises(ValueError, match="limit"):
            m.ExpertActivation("swiglu_oai", limit=bad)
    with pytest.raises(AttributeError):
        m.SILU.name = "relu2"  # frozen


def test_hand_computed_activations() -> None:
    """H = 2, I = 1: the gate row reads x0, the up row x1, w2 = [1, 2]^T, so out = [a, 2a] for activation a."""
    gate_up, w2 = [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]]
    a = 2 * _sigmoid(2) * 3
    _close(_hand_moe([2.0, 3.0], gate_up, w2, 0.5), [0.5 * a, a])  # SiLU(2) * 3, routing weight 0.5
    a = (3 + 1) * 2 * _sigmoid(1.702 * 2)
    _close(_hand_moe([2.0, 3.0], gate_up, w2, activation=m.SWIGLU_OAI), [a, 2 * a])
    a = (-7 + 1) * 7 * _sigmoid(1.702 * 7)  # both clamps reached: gate 10 -> 7, up -9 -> -7
    _close(_hand_moe([10.0, -9.0], gate_up, w2, activation=m.SWIGLU_OAI), [a, 2 * a])
    a = (7 + 1) * -20 * _sigmoid(1.702 * -20)  # a negative gate is not clamped from below; up 9 -> 7
    _close(_hand_moe([-20.0, 9.0], gate_up, w2, activation=m.SWIGLU_OAI), [a, 2 * a])
    other = m.ExpertActivation("swiglu_oai", alpha=1.0, limit=2.5)
    a = (2.5 + 1) * 2 * _sigmoid(2)
    _close(_hand_moe([2.0, 3.0], gate_up, w2, activation=other), [a, 2 * a])
    # ReLU^2 (not gated): one row h = x0 - x1
    _close(_hand_moe([5.0, 2.0], [[1.0, -1.0]], w2, activation=m.RELU2), [9.0, 18.0])
    _close(_hand_moe([2.0, 5.0], [[1.0, -1.0]], w2, activation=m.RELU2), [0.0, 0.0])


def test_hand_computed_biases_and_router_weight_on_input() -> None:
    gate_up, w2 = [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]]
    b13, b2 = torch.tensor([[0.5, -1.0]]), torch.tensor([[0.25, -4.0]])
    a = 2.5 * _sigmoid(2.5) * 2  # gate 2 + 0.5, up 3 - 1, before the activation
    _close(_hand_moe([2.0, 3.0], gate_up, w2, 0.5, w13_bias=b13, w2_bias=b2), [0.5 * (a + 0.25), 0.5 * (2 * a - 4)])
    h = 5 - 2 - 4.0  # relu2 with a bias that makes the row negative
    _close(
        _hand_moe([5.0, 2.0], [[1.0, -1.0]], w2, activation=m.RELU2, w13_bias=torch.tensor([[-4.0]]), w2_bias=b2),
        [max(h, 0) ** 2 + 0.25, 2 * max(h, 0) ** 2 - 4],
    )
    # the router weight on the input: SiLU(0.5 x0) * 0.5 x1, unweighted sum (the bias is not weighted either)
    a = 1 * _sigmoid(1) * 1.5
    _close(
        _hand_moe([2.0, 3.0], gate_up, w2, 0.5, w2_bias=b2, apply_router_weight_on_input=True), [a + 0.25, 2 * a - 4]
    )


@pytest.mark.vllm
def test_activations_are_vllms() -> None:
    """Our definitions against vLLM's own: SwigluOAIAndMul.forward_native reads gate and up interleaved (gpt-oss
    checkpoints), ours de-interleaved; ReLUSquaredActivation is relu2_no_mul's."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import ReLUSquaredActivation, SwigluOAIAndMul

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        swiglu = [SwigluOAIAndMul(a.alpha, a.limit) for a in (m.SWIGLU_OAI, m.ExpertActivation("swiglu_oai", 1.3, 3.0))]
        relu2 = ReLUSquaredActivation()
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 2 * 48, generator=gen) * 6  # past the clamp limit often
    gate, up = h.chunk(2, dim=-1)
    interleaved = torch.stack((gate, up), dim=-1).reshape(64, -1)
    for theirs in swiglu:
        ours = m.ExpertActivation("swiglu_oai", theirs.alpha, theirs.limit)
        torch.testing.assert_close(ours.torch_twin(h), theirs.forward_native(interleaved), rtol=0, atol=0)
    torch.testing.assert_close(m.RELU2.torch_twin(gate), relu2.forward_native(gate), rtol=0, atol=0)


def _layer(gen: torch.Generator, activation: m.ExpertActivation, e: int = 5, h: int = 48, i: int = 32):
    """Random NVFP4 experts (codes over the whole FP4 range) for ``activation``, with float32 biases."""
    rows = 2 * i if activation.gated else i
    w13 = m.quantize_nvfp4(torch.randn(e, rows, h, generator=gen) * 0.5, segments=2 if activation.gated else 1)
    w2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) / i**0.5)
    return w13, w2, torch.randn(e, rows, generator=gen), torch.randn(e, h, generator=gen)


def _routing(gen: torch.Generator, t: int, e: int, k: int):
    return m.topk_softmax(torch.randn(t, e, generator=gen), k, renormalize=False)


@pytest.mark.parametrize("activation", VARIANTS, ids=lambda a: a.name)
def test_activation_properties(activation: m.ExpertActivation, gen: torch.Generator) -> None:
    h = torch.randn(200, 2 * 16 if activation.gated else 16, generator=gen) * 8
    out = activation.torch_twin(h)
    assert out.shape == (200, 16)
    if activation is m.RELU2:
        assert (out >= 0).all() and torch.equal(out[h <= 0], torch.zeros_like(out[h <= 0]))
    elif activation is m.SWIGLU_OAI:  # past the limits the output no longer moves with the input
        gate, up = h.chunk(2, dim=-1)
        shifted = torch.cat((torch.where(gate > 7, gate + 5, gate), torch.where(up.abs() > 7, up * 2, up)), -1)
        assert ((gate > 7) | (up.abs() > 7)).any()
        assert torch.equal(activation.torch_twin(shifted), out)
    else:
        gate, up = h.chunk(2, dim=-1)
        torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("activation", VARIANTS, ids=lambda a: a.name)
def test_w2_bias_shifts_each_pair_by_its_weighted_bias(activation: m.ExpertActivation, gen: torch.Generator) -> None:
    w13, w2, _, b2 = _layer(gen, activation)
    x = torch.randn(9, 48, generator=gen)
    tw, ti = _routing(gen, 9, 5, 3)
    plain = m.fused_moe_torch(x, w13, w2, tw, ti, activation=activation)
    biased = m.fused_moe_torch(x, w13, w2, tw, ti, activation=activation, w2_bias=b2)
    shift = (tw[..., None] * b2[ti.long()]).sum(1)
    assert (biased - plain - shift).abs().max() <= IDENTITY_TOL * biased.abs().max()


def test_w13_bias_is_added_before_the_activation(gen: torch.Generator) -> None:
    """A w13 bias equals an extra input column of ones whose weights are the bias (relu2: no gate and up); w2 gains
    a zero output row for the extra column."""
    w13, w2, b13, _ = _layer(gen, m.RELU2)
    x = torch.randn(7, 48, generator=gen)
    tw, ti = _routing(gen, 7, 5, 2)
    ones = torch.cat((x, torch.ones(7, 1)), 1)
    extended13 = torch.cat((m.dequantize_nvfp4(w13), b13[..., None]), -1)
    dense2 = m.dequantize_nvfp4(w2)
    extended2 = torch.cat((dense2, torch.zeros(5, 1, dense2.shape[-1])), 1)
    want = moe_dense_torch(ones, extended13, extended2, tw, ti, activation=m.RELU2)[:, :48]
    got = m.fused_moe_torch(x, w13, w2, tw, ti, activation=m.RELU2, w13_bias=b13)
    assert (got - want).abs().max() <= IDENTITY_TOL * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", VARIANTS, ids=lambda a: a.name)
def test_router_weight_on_input_is_the_weighted_input(
    activation: m.ExpertActivation, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Top-1: the MoE of x * w (rounded to x's dtype, as vLLM rounds it) with unit routing weights; top-3: the sum
    over slots of the top-1 MoE of each slot."""
    w13, w2, b13, b2 = _layer(gen, activation)
    x = torch.randn(6, 48, generator=gen).to(dtype)
    tw, ti = _routing(gen, 6, 5, 1)
    tw = tw * 0.7  # weights below one, as sigmoid routing gives
    kw = dict(activation=activation, w13_bias=b13, w2_bias=b2, compute_dtype=torch.float64)
    got = m.fused_moe_torch(x, w13, w2, tw, ti, apply_router_weight_on_input=True, **kw)
    want = m.fused_moe_torch(x * tw.to(dtype), w13, w2, torch.ones_like(tw), ti, **kw)
    assert torch.equal(got, want)
    tw3, ti3 = _routing(gen, 6, 5, 3)
    got3 = m.fused_moe_torch(x, w13, w2, tw3, ti3, apply_router_weight_on_input=True, **kw).double()
    want3 = sum(
        m.fused_moe_torch(x * tw3[:, j : j + 1].to(dtype), w13, w2, torch.ones(6, 1), ti3[:, j : j + 1], **kw).double()
        for j in range(3)
    )
    assert (got3 - want3).abs().max() <= 3 * 2**-8 * want3.abs().max()  # each slot's output rounded to x's dtype


# ---- the API: packing, validation, the CPU op ----
@pytest.mark.parametrize("activation", VARIANTS, ids=lambda a: a.name)
def test_prepare_packs_each_activation_and_round_trips(activation: m.ExpertActivation, gen: torch.Generator) -> None:
    w13, w2, b13, b2 = _layer(gen, activation)
    weights = m.prepare_moe_weights(w13, w2, activation=activation, w13_bias=b13.bfloat16(), w2_bias=b2.half())
    assert weights.activation is activation
    assert weights.w13_packed.shape == (5, 128 if activation.gated else 64, 64)  # one padded block per matrix
    assert weights.w13_global.shape == ((5, 2) if activation.gated else (5,))
    assert weights.w13_bias.dtype == torch.float32 and weights.w13_bias.is_contiguous()
    assert torch.equal(weights.w13_bias, b13.bfloat16().float()) and torch.equal(weights.w2_bias, b2.half().float())
    back13, back2 = weights.to_nvfp4()
    for a, b in ((back13, w13), (back2, w2)):
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert torch.equal(a.global_scale.reshape(-1), b.global_scale.float().reshape(-1))
    assert weights.layer_shape(2, torch.bfloat16).gated is activation.gated


def test_prepare_rejects_bad_variants(gen: torch.Generator) -> None:
    w13, w2, b13, b2 = _layer(gen, m.SILU)
    r13, r2, rb13, _ = _layer(gen, m.RELU2)
    with pytest.raises(ValueError, match=r"I \(non-gated activation\)=64"):
        m.prepare_moe_weights(w13, w2, activation=m.RELU2)  # gate and up rows given to a non-gated activation
    with pytest.raises(ValueError, match="do not match"):
        m.prepare_moe_weights(r13, r2, activation=m.SILU)  # I rows are not 2I
    two = m.NVFP4Tensor(r13.packed, r13.block_scale, r13.global_scale[:, None].expand(5, 2).contiguous())
    with pytest.raises(ValueError, match=r"global scale must be \[E\] with a non-gated"):
        m.prepare_moe_weights(two, r2, activation=m.RELU2)
    with pytest.raises(TypeError, match="ExpertActivation"):
        m.prepare_moe_weights(w13, w2, activation="relu2")
    with pytest.raises(ValueError, match=r"w13_bias must be \[5, 64\]"):
        m.prepare_moe_weights(w13, w2, w13_bias=rb13)
    with pytest.raises(ValueError, match=r"w2_bias must be \[5, 48\]"):
        m.prepare_moe_weights(w13, w2, w2_bias=b2[:, :32])
    with pytest.raises(ValueError, match="w2_bias must be a floating-point"):
        m.prepare_moe_weights(w13, w2, w2_bias=b2.int())
    bad = b13.clone()
    bad[3, 7] = float("inf")
    with pytest.raises(ValueError, match=r"w13_bias has non-finite values \(expert 3\)"):
        m.prepare_moe_weights(w13, w2, w13_bias=bad)
    bad = b2.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"w2_bias has non-finite values \(expert 1\)"):
        m.prepare_moe_weights(w13, w2, w2_bias=bad)


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("activation", VARIANTS, ids=lambda a: a.name)
def test_cpu_fused_moe_is_the_reference(activation: m.ExpertActivation, on_input: bool, gen: torch.Generator) -> None:
    w13, w2, b13, b2 = _layer(gen, activation)
    weights = m.prepare_moe_weights(w13, w2, activation=activation, w13_bias=b13, w2_bias=b2)
    x = torch.randn(9, 48, generator=gen).bfloat16()
    tw, ti = _routing(gen, 9, 7, 2)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4], dtype=torch.int32)  # two global experts on another rank
    got = m.fused_moe(x, weights, tw, ti, expert_map=emap, apply_router_weight_on_input=on_input)
    want = m.fused_moe_torch(
        x,
        w13,
        w2,
        tw,
        ti,
        expert_map=emap,
        activation=activation,
        w13_bias=b13,
        w2_bias=b2,
        apply_router_weight_on_input=on_input,
    )
    assert torch.equal(got, want)


def test_custom_op_carries_the_variant(gen: torch.Generator) -> None:
    """opcheck with biases, a non-default activation and the router weight on the input; torch.compile traces it."""
    from moe_nvfp4.ops import fused_moe_op

    act = m.ExpertActivation("swiglu_oai", alpha=1.5, limit=4.0)
    w13, w2, b13, b2 = _layer(gen, act)
    weights = m.prepare_moe_weights(w13, w2, activation=act, w13_bias=b13, w2_bias=b2)
    x = torch.randn(5, 48, generator=gen).bfloat16()
    tw, ti = _routing(gen, 5, 5, 1)
    args = (x, list(weights.tensors), [], tw, ti, None, 48, 32, weights.layout.name, weights.w13_bias, weights.w2_bias)
    args += (act.name, act.alpha, act.limit, True)
    result = torch.library.opcheck(fused_moe_op, args)
    assert all(v == "SUCCESS" for v in result.values()), result

    @torch.compile(fullgraph=True, backend="eager")
    def layer(x, tw, ti):
        return m.fused_moe(x, weights, tw, ti, apply_router_weight_on_input=True) * 2

    want = m.fused_moe_torch(
        x, w13, w2, tw, ti, activation=act, w13_bias=b13, w2_bias=b2, apply_router_weight_on_input=True
    )
    assert torch.equal(layer(x, tw, ti), want * 2)


def test_layer_shape_knows_the_gemm1_width() -> None:
    """A non-gated layer is its own tuned-entry and autotune key, and its default config is valid for it."""
    from moe_nvfp4.shapes import LayerShape
    from moe_nvfp4.sm90.autotune import cache_key
    from moe_nvfp4.sm90.default_config import HOPPER_132
    from moe_nvfp4.sm90.tuned_configs import select_config

    gated = LayerShape(128, 6, 2688, 1856)
    plain = LayerShape(128, 6, 2688, 1856, gated=False)
    assert gated.entry_key != plain.entry_key and cache_key(gated, HOPPER_132) != cache_key(plain, HOPPER_132)
    for tokens in (1, 4, 64, 1024):
        assert plain.accepts(select_config(tokens, plain, HOPPER_132))


def test_host_wrapper_picks_the_config_for_the_layer(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_moe_sm90 without a config asks tuned_configs.select_config for this call's shape, GEMM1's width included
    (a relu2 layer is not gated) and the expert map's length as the routing's expert count; the op passes none."""
    from moe_nvfp4.sm90 import host as moe_sm90

    class Chosen(Exception):
        pass

    asked = []

    def select_config(tokens, shape, device):
        asked.append((tokens, shape))
        raise Chosen

    monkeypatch.setattr(moe_sm90, "select_config", select_config)
    w13, w2, _, _ = _layer(gen, m.RELU2)
    weights = m.prepare_moe_weights(w13, w2, activation=m.RELU2)
    x = torch.randn(3, 48, generator=gen).bfloat16()
    tw, ti = _routing(gen, 3, 7, 2)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4], dtype=torch.int32)
    with pytest.raises(Chosen):
        moe_sm90.fused_moe_sm90(x, weights, tw, ti.int(), emap)
    tokens, shape = asked[0]
    assert tokens == 3 and shape == weights.layer_shape(2, torch.bfloat16, emap)
    assert (shape.gated, shape.experts, shape.global_experts) == (False, 5, 7)
