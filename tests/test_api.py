"""Public API on CPU: packing round trip, input checks before any launch, dispatch, the custom op.

Bound: on CPU fused_moe runs the torch reference on the unpacked weights, so it must equal
fused_moe_torch exactly (same function, same float32 math).
"""

from __future__ import annotations

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.dispatch import _select


def _layer(gen: torch.Generator, e: int = 4, h: int = 48, i: int = 32):
    w13 = m.quantize_nvfp4(torch.randn(e, 2 * i, h, generator=gen), segments=2)
    w2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen))
    return w13, w2


def test_prepare_round_trips_to_checkpoint_tensors(gen: torch.Generator) -> None:
    w13, w2 = _layer(gen)
    weights = m.prepare_moe_weights(w13, w2)
    assert (weights.num_experts, weights.hidden, weights.intermediate) == (4, 48, 32)
    assert weights.w13_packed.shape == (4, 128, 64) and weights.w2_packed.shape == (4, 64, 64)  # rows to 64, K to 128
    back13, back2 = weights.to_nvfp4()
    for a, b in ((back13, w13), (back2, w2)):
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert torch.equal(a.global_scale.reshape(-1), b.global_scale.float().reshape(-1))


def test_shared_w13_scale_is_expanded_to_gate_and_up(gen: torch.Generator) -> None:
    w13, w2 = _layer(gen)
    shared = m.quantize_nvfp4(m.dequantize_nvfp4(w13))  # one global scale per expert
    weights = m.prepare_moe_weights(shared, w2)
    assert torch.equal(weights.w13_global, shared.global_scale[:, None].expand(4, 2))


def test_prepare_rejects_bad_weights(gen: torch.Generator) -> None:
    w13, w2 = _layer(gen)
    with pytest.raises(ValueError, match="do not match"):
        m.prepare_moe_weights(w13, m.quantize_nvfp4(torch.randn(4, 48, 48, generator=gen)))
    bad = m.NVFP4Tensor(w2.packed, w2.block_scale, w2.global_scale.clone())
    bad.global_scale[2] = float("nan")
    with pytest.raises(m.CheckpointError, match=r"w2\.weight_scale_2 \(expert 2\)"):
        m.prepare_moe_weights(w13, bad)


@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_cpu_fused_moe_is_the_reference(tokens: int, gen: torch.Generator) -> None:
    w13, w2 = _layer(gen)
    weights = m.prepare_moe_weights(w13, w2)
    x = torch.randn(tokens, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(tokens, 4, generator=gen), 2)
    assert torch.equal(m.fused_moe(x, weights, tw, ti), m.fused_moe_torch(x, w13, w2, tw, ti))


def test_inputs_are_checked_before_launch(gen: torch.Generator) -> None:
    weights = m.prepare_moe_weights(*_layer(gen))
    x = torch.randn(3, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(3, 4, generator=gen), 2)
    cases = [
        ((x.float(), weights, tw, ti), TypeError, "bfloat16 or float16"),
        ((x[:, :32], weights, tw, ti), ValueError, r"x must be \[T, 48\]"),
        ((x, weights, tw, ti[:2]), ValueError, "topk_ids must be"),
        ((x, weights, tw, ti.float()), TypeError, "int32 or int64"),
        ((x, weights, tw[:, :1], ti), ValueError, "must match topk_ids"),
        ((x, weights, tw, torch.zeros(3, 17, dtype=torch.int32)), ValueError, "k<=16"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            m.fused_moe(*args)
    with pytest.raises(ValueError, match="expert_map"):
        m.fused_moe(x, weights, tw, ti, expert_map=torch.zeros(2, 4, dtype=torch.int32))


def test_custom_op_under_torch_compile(gen: torch.Generator) -> None:
    """The fake implementation lets torch.compile trace through the op (fullgraph) on CPU."""
    w13, w2 = _layer(gen)
    weights = m.prepare_moe_weights(w13, w2)
    x = torch.randn(5, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(5, 4, generator=gen), 2)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(x, tw, ti):
        return m.fused_moe(x, weights, tw, ti) * 2

    assert torch.equal(layer(x, tw, ti), m.fused_moe(x, weights, tw, ti) * 2)


def test_eager_calls_skip_the_op_and_traces_see_it(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager forward runs the op's body without the op's dispatch (host time, api._through_op); a torch.compile
    trace and a dispatch mode (what make_fx and fake-tensor tracing use) see the one opaque op, with the same result
    as the eager call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import moe_nvfp4.ops as ops

    weights = m.prepare_moe_weights(*_layer(gen))
    x = torch.randn(5, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(5, 4, generator=gen), 2)
    eager = m.fused_moe(x, weights, tw, ti)

    class SeenOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with SeenOps() as seen:
        assert torch.equal(m.fused_moe(x, weights, tw, ti), eager)
    assert "moe_nvfp4.fused_moe.default" in seen.names
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: m.fused_moe(x, weights, tw, ti), fullgraph=True, backend=recording_backend)
    assert torch.equal(compiled(x), eager)
    assert any(node.target is torch.ops.moe_nvfp4.fused_moe.default for node in graphs[0].graph.nodes)

    def no_op(*args, **kwargs):
        raise AssertionError("an eager forward went through the custom op")

    monkeypatch.setattr(ops, "fused_moe_op", no_op)
    assert torch.equal(m.fused_moe(x, weights, tw, ti), eager)


def test_custom_op_passes_opcheck(gen: torch.Generator) -> None:
    """Schema, fake tensor and AOT-dispatch checks of torch.library for moe_nvfp4::fused_moe."""
    from moe_nvfp4.ops import fused_moe_op

    weights = m.prepare_moe_weights(*_layer(gen))
    x = torch.randn(5, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(5, 4, generator=gen), 2)
    args = (x, list(weights.tensors), [], tw, ti, None, 48, 32, weights.layout.name)
    result = torch.library.opcheck(fused_moe_op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_w4a4_moe_on_cpu_is_the_reference_and_refused_without_fp4_tensor_cores(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fused_moe_w4a4: the sm_100 weight layout round-trips to the checkpoint tensors, the CPU path (also under
    torch.compile, through the custom op's fake) is fused_moe_torch with the input scales, and a GPU without
    FP4 tensor cores is told to use fused_moe; bad input scales fail before any launch."""
    import moe_nvfp4.api as api
    import moe_nvfp4.prepare_weights as prepare_weights

    w13, w2 = _layer(gen, h=64, i=48)
    weights = m.prepare_moe_weights_w4a4(w13, w2)
    back13, back2 = weights.to_nvfp4()
    assert torch.equal(back13.packed, w13.packed) and torch.equal(back2.packed, w2.packed)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(9, 4, generator=gen), 2)
    s13, s2 = torch.tensor([0.7]), torch.tensor([0.3])
    ref = m.fused_moe_torch(x, w13, w2, tw, ti, w13_input_scale=s13, w2_input_scale=s2)
    assert torch.equal(m.fused_moe_w4a4(x, weights, tw, ti, w13_input_scale=s13, w2_input_scale=s2), ref)
    compiled = torch.compile(
        lambda x: m.fused_moe_w4a4(x, weights, tw, ti, w13_input_scale=s13, w2_input_scale=s2),
        fullgraph=True,
        backend="eager",
    )
    assert torch.equal(compiled(x), ref)
    with pytest.raises(ValueError, match="w2_input_scale must be one float32"):
        m.fused_moe_w4a4(x, weights, tw, ti, w13_input_scale=s13, w2_input_scale=torch.ones(2))
    with pytest.raises(ValueError, match="weights are in the sm100_interleaved layout"):
        m.fused_moe(x, weights, tw, ti)  # the 16-bit-activation kernels would read another layout's bytes
    monkeypatch.setattr(api, "select_backends", lambda device: _select("sm_100", "cute"))
    with pytest.raises(ValueError, match="weights are in the sm90_fragments layout, but cpu runs the W4A4 MoE on cute"):
        m.fused_moe_w4a4(x, m.prepare_moe_weights(w13, w2), tw, ti, w13_input_scale=s13, w2_input_scale=s2)
    for module in (api, prepare_weights):
        monkeypatch.setattr(module, "select_backends", lambda device: _select("sm_90", None))
    with pytest.raises(ValueError, match="use fused_moe"):
        m.fused_moe_w4a4(x, weights, tw, ti, w13_input_scale=s13, w2_input_scale=s2)
    with pytest.raises(ValueError, match="use prepare_moe_weights"):
        m.prepare_moe_weights_w4a4(w13, w2)


def test_expert_map_is_checked_before_launch(gen: torch.Generator) -> None:
    """Metadata only (no values read): dtype and rank, the device of topk_ids, one entry per global expert."""
    weights = m.prepare_moe_weights(*_layer(gen))  # 4 local experts
    x = torch.randn(3, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(3, 6, generator=gen), 2)
    cases = [
        (torch.arange(6.0), "1-D int32 or int64"),
        (torch.zeros(2, 3, dtype=torch.int32), "1-D int32 or int64"),
        (torch.arange(6, dtype=torch.int32, device="meta"), "expert_map is on meta, topk_ids on cpu"),
        (torch.arange(3, dtype=torch.int32), "expert_map has 3 entries but the weights hold 4 local experts"),
    ]
    for emap, msg in cases:
        with pytest.raises(ValueError, match=msg):
            m.fused_moe(x, weights, tw, ti, expert_map=emap)


@pytest.mark.parametrize("with_map", [False, True])
def test_out_of_range_routing_contributes_nothing(with_map: bool, gen: torch.Generator) -> None:
    """Ids outside [0, E_global) and map entries outside [0, E) are no error: their pairs contribute nothing, the
    output equals the one where those pairs carry weight 0 on a valid expert (exactly: the same float32 sums with
    zero terms), and a token with only such pairs gets zeros."""
    w13, w2 = _layer(gen)
    weights = m.prepare_moe_weights(w13, w2)
    t, n_global = 6, 7 if with_map else 4
    x = torch.randn(t, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, n_global, generator=gen), 3)
    # map: global 0 and 5 on another rank, global 6 a corrupt entry past the local experts
    emap = torch.tensor([-1, 0, 1, 2, 3, -1, 9], dtype=torch.int32) if with_map else None
    ti[0] = torch.tensor([-1, n_global, 1000])
    ti[1, 1] = -(2**31)
    routed = (ti >= 0) & (ti < n_global)
    if with_map:
        routed &= emap[ti.clamp(0, n_global - 1).long()] >= 0
        routed &= emap[ti.clamp(0, n_global - 1).long()] < 4
    clean_id = 1  # a routed expert with and without the map
    out = m.fused_moe(x, weights, tw, ti, expert_map=emap)
    want = m.fused_moe(x, weights, torch.where(routed, tw, 0.0), torch.where(routed, ti, clean_id), expert_map=emap)
    assert torch.equal(out, want) and not routed[0].any() and bool((out[0] == 0).all())
    assert torch.equal(out, m.fused_moe_torch(x, w13, w2, tw, ti, expert_map=emap))


def test_strided_x_is_copied_not_misread(gen: torch.Generator) -> None:
    """x with a non-unit stride along H (x[:, ::2]) is copied to unit stride before any kernel: the same output as
    the contiguous copy (the kernels address a row's values as consecutive)."""
    weights = m.prepare_moe_weights(*_layer(gen))
    wide = torch.randn(5, 96, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(5, 4, generator=gen), 2)
    assert wide[:, ::2].stride() == (96, 2)
    assert torch.equal(
        m.fused_moe(wide[:, ::2], weights, tw, ti), m.fused_moe(wide[:, ::2].contiguous(), weights, tw, ti)
    )


def test_grouped_gemm_refuses_block_scales_that_are_not_e4m3(gen: torch.Generator) -> None:
    """float32, bf16 or a uint8 view of block scales would be read as e4m3 bytes (garbage): refused by name."""
    a = m.quantize_nvfp4(torch.randn(8, 32, generator=gen))
    b = m.quantize_nvfp4(torch.randn(16, 32, generator=gen))
    for dtype in (torch.float32, torch.bfloat16):
        bad = m.NVFP4Tensor(b.packed, b.block_scale.to(dtype), b.global_scale)
        with pytest.raises(TypeError, match=rf"group 0: B\.block_scale must be torch\.float8_e4m3fn .*got {dtype}"):
            m.grouped_gemm_nvfp4([a], [bad])
    raw = m.NVFP4Tensor(a.packed, a.block_scale.view(torch.uint8), a.global_scale)
    with pytest.raises(TypeError, match=r"group 1: A\.block_scale must be torch\.float8_e4m3fn"):
        m.plan_grouped_gemm_nvfp4([a, raw], [b, b])


def test_int64_routing_past_int32_does_not_wrap_onto_an_expert(gen: torch.Generator) -> None:
    """An int64 id (or map entry) of 2^32 + 1 is out of range, not expert 1: the kernels take int32, and the cast
    saturates instead of wrapping."""
    weights = m.prepare_moe_weights(*_layer(gen))
    x = torch.randn(3, 48, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(3, 4, generator=gen), 2)
    wrapped = ti.long()
    wrapped[:, 0] = 2**32 + 1
    dropped = ti.clone()
    dropped[:, 0] = -1
    assert torch.equal(m.fused_moe(x, weights, tw, wrapped), m.fused_moe(x, weights, tw, dropped))
    emap = torch.arange(4, dtype=torch.int64)
    emap[2] = 2**32 + 2
    ids = torch.tensor([[2, 1], [2, 3], [0, 2]], dtype=torch.int32)
    no_expert_2 = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    assert torch.equal(
        m.fused_moe(x, weights, tw, ids, expert_map=emap), m.fused_moe(x, weights, tw, ids, expert_map=no_expert_2)
    )
