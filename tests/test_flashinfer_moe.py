"""The FlashInfer W4A4 MoE backend on CPU: the weight/scale layout against the documented TRT-LLM-gen formulas
and, byte for byte, against FlashInfer's own Python-side permutation helpers (run from its installed source:
``import flashinfer`` needs a CUDA build of torch); the round trip back to our format; the forward through
the API (the reference on the unpacked weights); the arguments handed to FlashInfer, with FlashInfer mocked at
its boundary.  Layouts are exact: bytes compared with ``torch.equal``."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
import types

import pytest
import torch

import moe_nvfp4 as m
import moe_nvfp4.api as api
import moe_nvfp4.prepare_weights as prepare_weights
from moe_nvfp4.dispatch import _select
from moe_nvfp4.flashinfer_moe import fused_moe_w4a4_flashinfer
from moe_nvfp4.weight_layouts import FlashInferLayout, gated_rows_order, shuffle_rows_order


def prepare_moe_weights_flashinfer(w13: m.NVFP4Tensor, w2: m.NVFP4Tensor, *, expert_offset: int = 0) -> m.MoEWeights:
    """The FlashInfer layout whatever the device (the API packs in it only where dispatch picks FlashInfer)."""
    return prepare_weights._packed(w13, w2, FlashInferLayout(expert_offset=expert_offset))


# TRT-LLM-gen's srcToDstBlk32RowMap, as printed in its source: old row r of a 32-row block goes to row MAP[r].
BLK32_MAP = [
    0,
    8,
    16,
    24,
    1,
    9,
    17,
    25,
    2,
    10,
    18,
    26,
    3,
    11,
    19,
    27,
    4,
    12,
    20,
    28,
    5,
    13,
    21,
    29,
    6,
    14,
    22,
    30,
    7,
    15,
    23,
    31,
]


def _experts(gen: torch.Generator, e: int, h: int, i: int) -> tuple[m.NVFP4Tensor, m.NVFP4Tensor]:
    """Checkpoint tensors with every FP4 code and random e4m3 scales; gate and up with different globals."""

    def rand(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(e, n, k // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)
        return packed, scales

    w13 = m.NVFP4Tensor(*rand(2 * i, h), torch.rand(e, 2, generator=gen) + 0.5)
    w2 = m.NVFP4Tensor(*rand(h, i), torch.rand(e, generator=gen) + 0.5)
    return w13, w2


def test_row_orders_follow_the_documented_maps() -> None:
    order = shuffle_rows_order(64)
    for block in (0, 32):
        for r in range(32):
            assert order[block + BLK32_MAP[r]] == block + r
    assert gated_rows_order(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="multiple of 32"):
        shuffle_rows_order(48)


@pytest.mark.parametrize(("e", "h", "i"), [(3, 256, 64), (2, 96, 48), (1, 512, 128)])  # aligned; padded H and I
def test_round_trip_and_padding(gen, e, h, i) -> None:
    w13, w2 = _experts(gen, e, h, i)
    packed = prepare_moe_weights_flashinfer(w13, w2)
    i_pad, h_pad = -(-i // 64) * 64, -(-h // 256) * 256
    assert packed.w13_packed.shape == (e, 2 * i_pad, h_pad // 2) and packed.w13_scale.shape == (
        e,
        2 * i_pad,
        h_pad // 16,
    )
    assert packed.w2_packed.shape == (e, h_pad, i_pad // 2) and packed.w2_scale.shape == (e, h_pad, i_pad // 16)
    assert packed.w13_scale.dtype == packed.w2_scale.dtype == torch.float8_e4m3fn
    back13, back2 = packed.to_nvfp4()
    for got, want in ((back13, w13), (back2, w2)):
        assert torch.equal(got.packed, want.packed)
        assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
        assert torch.equal(got.global_scale, want.global_scale)
    # Padding is zero codes and zero scales: it contributes nothing whatever the activations hold there.
    assert int(packed.w13_packed.sum()) == int(w13.packed.long().sum())
    assert int(packed.w2_packed.sum()) == int(w2.packed.long().sum())


def _flashinfer_helpers() -> dict:
    """FlashInfer's pure-torch row-permutation helpers, executed from its installed source files."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None:  # .ci/run's vLLM 0.26 environment has it (vLLM's deps list); the 0.33 one leaves GPU packages out
        pytest.skip("FlashInfer's sources are not installed (vLLM 0.26's CPU environment of .ci/run has them)")
    root = pathlib.Path(spec.origin).parent
    wanted = {
        "utils.py": {
            "srcToDstBlk16RowMap",
            "srcToDstBlk32RowMap",
            "get_shuffle_block_size",
            "get_shuffle_matrix_a_row_indices",
            "get_shuffle_matrix_sf_a_row_indices",
        },
        "fused_moe/core.py": {
            "get_reorder_rows_for_gated_act_gemm_row_indices",
            "_maybe_get_cached_w3_w1_permute_indices",
            "get_w2_permute_indices_with_cache",
        },
    }
    namespace = {"torch": torch, "Union": __import__("typing").Union}
    for file, names in wanted.items():
        tree = ast.parse((root / file).read_text())
        nodes = [
            n
            for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name in names)
            or (isinstance(n, ast.Assign) and {getattr(t, "id", None) for t in n.targets} & names)
        ]
        assert len(nodes) == len(names), f"{file}: found {len(nodes)} of {sorted(names)}"
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(root / file), "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.vllm
@pytest.mark.parametrize(("e", "h", "i"), [(2, 256, 64), (3, 512, 192)])
def test_layout_matches_flashinfer_helpers(gen, e, h, i) -> None:
    """vLLM 0.26's ``prepare_static_weights_for_trtllm_fp4_moe`` with FlashInfer's helpers, rebuilt step by step
    ([w1, w3] -> [w3, w1], FlashInfer's permutation per expert for values and scales, then the 128x4 swizzle,
    ``swizzle_scales_128x4``, checked against the documented formula in test_layouts), gives our bytes."""
    fi = _flashinfer_helpers()
    w13, w2 = _experts(gen, e, h, i)
    ours = prepare_moe_weights_flashinfer(w13, w2)
    cache: dict = {}
    swap = lambda t: torch.cat((t[:, i:], t[:, :i]), 1)  # noqa: E731
    v13, s13 = swap(w13.packed), swap(w13.block_scale.view(torch.uint8))
    v2, s2 = w2.packed, w2.block_scale.view(torch.uint8)
    for x in range(e):
        rows = fi["_maybe_get_cached_w3_w1_permute_indices"](cache, v13[x], 128, is_gated_act_gemm=True)
        sf_rows = fi["_maybe_get_cached_w3_w1_permute_indices"](
            cache, s13[x], 128, num_elts_per_sf=16, is_gated_act_gemm=True
        )
        assert torch.equal(ours.w13_packed[x], v13[x][rows])
        assert torch.equal(ours.w13_scale[x].view(torch.uint8), m.swizzle_scales_128x4(s13[x][sf_rows]))
        rows = fi["get_w2_permute_indices_with_cache"](cache, v2[x], 128)
        sf_rows = fi["get_w2_permute_indices_with_cache"](cache, s2[x], 128, num_elts_per_sf=16)
        assert torch.equal(ours.w2_packed[x], v2[x][rows])
        assert torch.equal(ours.w2_scale[x].view(torch.uint8), m.swizzle_scales_128x4(s2[x][sf_rows]))


def test_api_forward_on_the_flashinfer_layout(gen, monkeypatch) -> None:
    """Where dispatch picks FlashInfer (sm_100; faked) the API packs for it; on CPU tensors the op runs the
    reference on the unpacked weights: equal to fused_moe_torch on the originals (same code, exact), with and
    without expert parallelism (this rank holds global experts 2..4 of 7)."""
    for module in (api, prepare_weights):  # the forward and the packing
        monkeypatch.setattr(module, "select_backends", lambda device: _select("sm_100", None))
    e, h, i, t = 3, 96, 48, 11
    w13, w2 = _experts(gen, e, h, i)
    weights = m.prepare_moe_weights_w4a4(w13, w2)
    assert isinstance(weights, m.MoEWeights) and weights.layout == FlashInferLayout()
    x = torch.randn(t, h, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, e, generator=gen), 2)
    s13, s2 = torch.tensor([0.02]), torch.tensor([0.05])
    ref = m.fused_moe_torch(x, w13, w2, tw, ti, w13_input_scale=s13, w2_input_scale=s2)
    assert torch.equal(m.fused_moe_w4a4(x, weights, tw, ti, w13_input_scale=s13, w2_input_scale=s2), ref)

    expert_map = torch.tensor([-1, -1, 0, 1, 2, -1, -1], dtype=torch.int32)
    ep = m.prepare_moe_weights_w4a4(w13, w2, expert_offset=2)
    tw, ti = m.topk_softmax(torch.randn(t, 7, generator=gen), 3)
    ref = m.fused_moe_torch(x, w13, w2, tw, ti, expert_map=expert_map, w13_input_scale=s13, w2_input_scale=s2)
    got = m.fused_moe_w4a4(x, ep, tw, ti, expert_map=expert_map, w13_input_scale=s13, w2_input_scale=s2)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="expert_map has only 4 entries"):
        m.fused_moe_w4a4(x, ep, tw, ti % 4, expert_map=expert_map[:4], w13_input_scale=s13, w2_input_scale=s2)
    monkeypatch.setattr(api, "select_backends", lambda device: _select("sm_100", "cute"))
    with pytest.raises(ValueError, match="flashinfer_trtllm layout, but cpu runs the W4A4 MoE on cute"):
        m.fused_moe_w4a4(x, ep, tw, ti, expert_map=expert_map, w13_input_scale=s13, w2_input_scale=s2)


def test_arguments_handed_to_flashinfer(gen, monkeypatch) -> None:
    """FlashInfer mocked at its boundary: the quantizer gets the padded bf16 activations and 1 / a13 with linear
    scales; the MoE gets routing as (int32 ids, bf16 weights), our packed tensors, scale_gate = a13 * gs_gate,
    scale_c = a13 * gs_up / a2, out2 = a2 * gs_w2, the padded intermediate size and the local expert range;
    the output comes back cut to H in x's dtype."""
    e, h, i, t = 4, 96, 48, 5
    w13, w2 = _experts(gen, e, h, i)
    weights = prepare_moe_weights_flashinfer(w13, w2, expert_offset=4)
    calls: dict = {}

    def fp4_quantize(x, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout):
        calls["quantize"] = dict(
            x=x, global_scale=global_scale, sf_vec_size=sf_vec_size, ue8m0=sf_use_ue8m0, swizzled=is_sf_swizzled_layout
        )
        return torch.zeros(x.shape[0], x.shape[1] // 2, dtype=torch.uint8), torch.zeros(
            x.shape[0] * x.shape[1] // 16, dtype=torch.uint8
        )

    def routed_moe(**kwargs):
        calls["moe"] = kwargs
        kwargs["output"].copy_(torch.arange(kwargs["output"].numel(), dtype=torch.float32).view_as(kwargs["output"]))
        return [kwargs["output"]]

    fused = types.ModuleType("flashinfer.fused_moe")
    fused.trtllm_fp4_block_scale_routed_moe = routed_moe
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.fp4_quantize, flashinfer.fused_moe = fp4_quantize, fused
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused)

    x = torch.randn(t, h, generator=gen).half()
    tw, ti = m.topk_softmax(torch.randn(t, 12, generator=gen), 2)
    a13, a2 = torch.tensor([0.25]), torch.tensor([0.125])
    global_map = torch.zeros(12, dtype=torch.int32)  # only its length counts: the kernel routes by the offset
    out = fused_moe_w4a4_flashinfer(x, weights, tw, ti.to(torch.int32), global_map, (a13, a2))

    q = calls["quantize"]
    assert q["x"].dtype == torch.bfloat16 and q["x"].shape == (t, 256)
    assert torch.equal(q["x"][:, :h], x.bfloat16()) and not q["x"][:, h:].any()
    assert torch.equal(q["global_scale"], 1.0 / a13) and (q["sf_vec_size"], q["ue8m0"], q["swizzled"]) == (
        16,
        False,
        False,
    )
    k = calls["moe"]
    ids, weights_bf16 = k["topk_ids"]
    assert (
        ids.dtype == torch.int32 and torch.equal(ids, ti.to(torch.int32)) and torch.equal(weights_bf16, tw.bfloat16())
    )
    assert k["hidden_states_scale"].dtype == torch.float8_e4m3fn and k["hidden_states_scale"].shape == (t, 16)
    for name, tensor in (
        ("gemm1_weights", weights.w13_packed),
        ("gemm1_weights_scale", weights.w13_scale),
        ("gemm2_weights", weights.w2_packed),
        ("gemm2_weights_scale", weights.w2_scale),
    ):
        assert k[name] is tensor
    gs = w13.global_scale
    torch.testing.assert_close(k["output1_scale_gate_scalar"], 0.25 * gs[:, 0], rtol=1e-6, atol=0)
    torch.testing.assert_close(k["output1_scale_scalar"], 0.25 * gs[:, 1] / 0.125, rtol=1e-6, atol=0)
    torch.testing.assert_close(k["output2_scale_scalar"], 0.125 * w2.global_scale, rtol=1e-6, atol=0)
    assert (k["num_experts"], k["top_k"], k["intermediate_size"]) == (12, 2, 64)
    assert (k["local_expert_offset"], k["local_num_experts"], k["activation_type"], k["do_finalize"]) == (4, 4, 3, True)
    assert all(k[n] is None for n in ("routing_bias", "gemm1_bias", "gemm2_bias", "gemm1_alpha", "gemm1_clamp_limit"))
    assert out.dtype == torch.float16 and out.shape == (t, h)
    assert torch.equal(out, k["output"][:, :h].half())
    assert fused_moe_w4a4_flashinfer(x[:0], weights, tw[:0], ti[:0], global_map, (a13, a2)).shape == (0, h)
