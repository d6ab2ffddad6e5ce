"""CPU tests of the vLLM plugin (``--quantization nvfp4_grouped``) on whichever supported vLLM is installed.

CI runs this file twice, under vLLM 0.26.0 and under 0.33.0, each in its own environment (.ci/run); tests of a
path only one release has say so in their skip reason, and ``moe_nvfp4_vllm.compat`` names every difference.
The MoE method is tested on a real vLLM ``RoutedExperts`` built on CPU (FusedMoEConfig with an explicit
FusedMoEParallelConfig for each TP / EP rank, ExpertMapManager, and a VllmConfig on device "cpu"), loaded
through ``RoutedExperts.load_weights`` with checkpoint tensor names: the same weight loader, TP slicing and
expert mapping vLLM uses.  The MoE runner is tested whole: vLLM's own factory builds the layer (router,
runner, RoutedExperts) and its forward calls our ``apply``.  Without a GPU vLLM cannot build a whole model, so
LLM(...) runs in tests/gpu (vLLM 0.26 only: the GPU image's torch 2.11 cannot run 0.33).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from test_fuzz_plugin_config import BAD_CONFIGS, EXAMPLES_VLLM, assert_names_a_field, configs

pytestmark = pytest.mark.vllm

# Tolerances: the plugin on CPU runs moe_nvfp4.fused_moe's torch path on the exact NVFP4 values, so
# outputs match fused_moe_torch up to bf16 output rounding (and summation order across TP ranks).
TOL = {"atol": 2e-5, "rtol": 2e-2}

E, H, I, TOPK, T = 4, 64, 64, 2, 7
LAYER = "model.layers.0.mlp.experts"
MODELOPT_W4A16 = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "ignore": ["lm_head"]}
MODELOPT_W4A4 = {**MODELOPT_W4A16, "quant_algo": "NVFP4"}
# hf_quant_config.json as ModelOpt <= 0.29 writes it; vLLM adds quant_method "modelopt_fp4" (producer modelopt).
HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    },
    "quant_method": "modelopt_fp4",
}
_FP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
}


def _ct(w4a4: bool) -> dict:
    act = {**_FP4, "dynamic": "local"} if w4a4 else None
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(_FP4),
                "input_activations": act,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }


@pytest.fixture(scope="module")
def plugin():
    from moe_nvfp4_vllm.plugin import register

    register()
    from moe_nvfp4_vllm import config

    return config


# ---------------------------------------------------------------- registration


def test_register_is_idempotent(plugin):
    from moe_nvfp4_vllm.plugin import register
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()
    assert QUANTIZATION_METHODS.count("nvfp4_grouped") == 1
    assert get_quantization_config("nvfp4_grouped") is plugin.NVFP4GroupedConfig


def test_entry_point_registers_through_load_general_plugins(monkeypatch):
    """The installed distribution declares the plugin; vLLM's loader (run in every process) registers it."""
    from importlib.metadata import entry_points

    import vllm.plugins
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG, get_quantization_config

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    if "nvfp4_grouped" not in eps:
        pytest.fail("entry point missing: install the package (pip install -e .) so vllm.general_plugins lists it")
    assert eps["nvfp4_grouped"] == "moe_nvfp4_vllm.plugin:register"
    monkeypatch.delitem(_CUSTOMIZED_METHOD_TO_QUANT_CONFIG, "nvfp4_grouped", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    assert get_quantization_config("nvfp4_grouped").__name__ == "NVFP4GroupedConfig"


# ---------------------------------------------------------------- config parsing


@dataclass(frozen=True)
class ConfigCase:
    why: str
    cfg: dict
    convention: str | None
    input_scales: bool
    delegate: str | None


CONFIG_CASES = [
    ConfigCase(
        "our converter / ModelOpt >= 0.31 config.json, weight-only",
        MODELOPT_W4A16,
        "modelopt",
        False,
        "ModelOptNvFp4Config",
    ),
    ConfigCase("ModelOpt W4A4: input scales required", MODELOPT_W4A4, "modelopt", True, "ModelOptNvFp4Config"),
    ConfigCase(
        "hf_quant_config.json (nested, producer modelopt)", HF_QUANT_CONFIG, "modelopt", True, "ModelOptNvFp4Config"
    ),
    ConfigCase("compressed-tensors NVFP4A16", _ct(False), "compressed-tensors", False, "CompressedTensorsConfig"),
    ConfigCase("compressed-tensors NVFP4 W4A4", _ct(True), "compressed-tensors", True, "CompressedTensorsConfig"),
    ConfigCase("no quantization config: BF16 quantized on load", {}, None, False, None),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.why)
def test_from_config(plugin, case):
    qc = plugin.NVFP4GroupedConfig.from_config(case.cfg)
    assert (qc.convention.value if qc.convention else None) == case.convention
    assert qc.input_scales == case.input_scales
    assert (type(qc.delegate).__name__ if qc.delegate else None) == case.delegate
    assert qc.get_name() == "nvfp4_grouped"


def test_bf16_config_constructs_without_arguments(plugin):
    """vLLM calls quant_cls() when the checkpoint has no quantization config (get_config_filenames is [])."""
    assert plugin.NVFP4GroupedConfig.get_config_filenames() == []
    assert plugin.NVFP4GroupedConfig().convention is None


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo='FP8'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method='fp8'"),
        ({**MODELOPT_W4A16, "group_size": 32}, "group_size 16"),
    ],
    ids=["modelopt-fp8", "fp8", "group-32"],
)
def test_from_config_rejects(plugin, cfg, match):
    with pytest.raises(ValueError, match=match):
        plugin.NVFP4GroupedConfig.from_config(cfg)


@pytest.mark.parametrize(
    "cfg, user, expected",
    [
        (MODELOPT_W4A16, "nvfp4_grouped", "nvfp4_grouped"),
        (HF_QUANT_CONFIG, "nvfp4_grouped", "nvfp4_grouped"),
        (_ct(True), "nvfp4_grouped", "nvfp4_grouped"),
        (MODELOPT_W4A16, None, None),  # without the flag vLLM's modelopt_fp4 keeps the checkpoint
        (_ct(False), "compressed-tensors", None),
        ({"quant_method": "fp8"}, "nvfp4_grouped", None),  # vLLM then reports the mismatch
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "nvfp4_grouped", None),
    ],
)
def test_override_quantization_method(plugin, cfg, user, expected):
    assert plugin.NVFP4GroupedConfig.override_quantization_method(dict(cfg), user) == expected


def test_custom_overrides_are_probed_before_vllms(plugin):
    """vLLM's _verify_quantization (0.26 and 0.33) puts custom methods first; modelopt_fp4 would otherwise claim it."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    assert "nvfp4_grouped" in QUANTIZATION_METHODS
    modelopt = get_quantization_config("modelopt_fp4")
    assert modelopt.override_quantization_method(dict(MODELOPT_W4A16), "nvfp4_grouped") == "modelopt_fp4"
    assert (
        plugin.NVFP4GroupedConfig.override_quantization_method(dict(MODELOPT_W4A16), "nvfp4_grouped") == "nvfp4_grouped"
    )


def test_linear_layers_are_delegated(plugin):
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    class FakeLinear(LinearBase):  # get_quant_method only looks at the type
        def __init__(self):
            torch.nn.Module.__init__(self)

    bf16 = plugin.NVFP4GroupedConfig()
    assert isinstance(bf16.get_quant_method(FakeLinear(), "model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod)
    mo = plugin.NVFP4GroupedConfig.from_config(dict(MODELOPT_W4A16))
    assert isinstance(mo.get_quant_method(FakeLinear(), "lm_head"), UnquantizedLinearMethod)
    seen = []
    mo.delegate.get_quant_method = lambda layer, prefix: seen.append(prefix) or "delegated"
    assert mo.get_quant_method(FakeLinear(), "model.layers.0.self_attn.o_proj") == "delegated"
    assert seen == ["model.layers.0.self_attn.o_proj"]


# ---------------------------------------------------------------- a real RoutedExperts on CPU


def _routed_experts(
    qc,
    *,
    tp=1,
    tp_rank=0,
    ep=1,
    ep_rank=0,
    inter=I,
    activation="silu",
    top_k=TOPK,
    has_bias=False,
    router_weight_on_input=False,
    swiglu=None,
):
    """A RoutedExperts layer as vLLM's models build it.  A non-gated activation (``*_no_mul``) gets NemotronH's
    checkpoint names (its ``up_proj`` is shard w1, no up shard); ``swiglu``: (limit, alpha, beta) of the config."""
    from unittest import mock

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import config as moe_config_module
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    use_ep = ep > 1
    pc = FusedMoEParallelConfig(
        tp_size=1 if use_ep else tp,
        pcp_size=1,
        dp_size=1,
        ep_size=ep,
        tp_rank=0 if use_ep else tp_rank,
        pcp_rank=0,
        dp_rank=0,
        ep_rank=ep_rank,
        sp_size=1,
        use_ep=use_ep,
        all2all_backend="allgather_reducescatter",
        enable_eplb=False,
    )
    act = MoEActivation.from_str(activation)
    limit, alpha, beta = swiglu or (None, None, None)
    # vLLM builds non-gated MoE configs only on CUDA/ROCm/XPU platforms; the layer itself is platform-free.
    with mock.patch.object(moe_config_module.current_platform, "is_cuda_alike", return_value=True):
        cfg = FusedMoEConfig(
            num_experts=E,
            experts_per_token=top_k,
            hidden_dim=H,
            intermediate_size=inter,
            num_local_experts=E // ep,
            num_logical_experts=E,
            activation=act,
            device="cpu",
            routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=pc,
            in_dtype=torch.bfloat16,
            has_bias=has_bias,
            swiglu_limit=limit,
            swiglu_alpha=alpha,
            swiglu_beta=beta,
        )
    # NemotronH's names: vLLM 0.26 spells "no up projection" "", 0.33 None (and checks it against the activation)
    no_up = "" if _release() == (0, 26) else None
    names = {} if act.is_gated else {"ckpt_gate_proj_name": "up_proj", "ckpt_up_proj_name": no_up}
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        emm = ExpertMapManager(
            max_num_batched_tokens=256,
            top_k=top_k,
            global_num_experts=E,
            num_redundant_experts=0,
            num_expert_group=None,
            moe_parallel_config=pc,
            placement_strategy="linear",
            enable_eplb=False,
        )
        return RoutedExperts(
            LAYER, torch.bfloat16, cfg, qc, emm, apply_router_weight_on_input=router_weight_on_input, **names
        )


@dataclass
class Experts:
    """Reference experts and their checkpoint tensors (per-expert names, as HF checkpoints hold them)."""

    w13: object  # NVFP4Tensor [E, 2I, H], global [E, 2]
    w2: object
    tensors: dict  # "<e>.<proj>.<suffix>" -> tensor
    dense13: torch.Tensor | None = None
    dense2: torch.Tensor | None = None


def _experts(gen, convention="modelopt", *, w4a4=False, inter=I) -> Experts:
    import moe_nvfp4

    d13 = torch.randn(E, 2 * inter, H, generator=gen) * 0.02
    d13[:, inter:] *= 3  # up rows with a different range: separate gate/up global scales must stay exact
    d2 = torch.randn(E, H, inter, generator=gen) * 0.02
    q13 = moe_nvfp4.quantize_nvfp4(d13, segments=2)
    q2 = moe_nvfp4.quantize_nvfp4(d2)
    ct = convention == "compressed-tensors"
    names = (
        ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
        if ct
        else ("weight", "weight_scale", "weight_scale_2", "input_scale")
    )
    tensors = {}
    for e in range(E):
        parts = {
            "gate_proj": (q13.packed[e, :inter], q13.block_scale[e, :inter], q13.global_scale[e, 0]),
            "up_proj": (q13.packed[e, inter:], q13.block_scale[e, inter:], q13.global_scale[e, 1]),
            "down_proj": (q2.packed[e], q2.block_scale[e], q2.global_scale[e]),
        }
        for proj, (packed, scale, gs) in parts.items():
            tensors[f"{e}.{proj}.{names[0]}"] = packed.clone()
            tensors[f"{e}.{proj}.{names[1]}"] = scale.clone()
            tensors[f"{e}.{proj}.{names[2]}"] = (1.0 / gs if ct else gs).reshape(
                1 if e % 2 else ()
            )  # both scalar forms
            if w4a4:
                a = torch.tensor(0.5 + e / 10)
                tensors[f"{e}.{proj}.{names[3]}"] = 1.0 / a if ct else a
    return Experts(q13, q2, tensors, d13.bfloat16(), d2.bfloat16())


def _config(plugin, convention, w4a4=False):
    if convention == "modelopt":
        return plugin.NVFP4GroupedConfig.from_config(dict(MODELOPT_W4A4 if w4a4 else MODELOPT_W4A16))
    if convention == "compressed-tensors":
        return plugin.NVFP4GroupedConfig.from_config(_ct(w4a4))
    return plugin.NVFP4GroupedConfig()


def _load(layer, tensors: dict) -> None:
    list(layer.load_weights(iter(sorted(tensors.items()))))
    layer.quant_method.process_weights_after_loading(layer)


def _routing(gen, t=T):
    x = (torch.randn(t, H, generator=gen)).bfloat16()
    logits = torch.randn(t, E, generator=gen)
    tw, ids = torch.topk(logits.softmax(-1), TOPK, dim=-1)
    return x, (tw / tw.sum(-1, keepdim=True)).float(), ids.int()


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["weight-only", "w4a4"])
def test_load_and_apply_matches_reference(plugin, gen, convention, w4a4):
    import moe_nvfp4

    ex = _experts(gen, convention, w4a4=w4a4)
    layer = _routed_experts(_config(plugin, convention, w4a4))
    assert type(layer.quant_method).__name__ == "NVFP4GroupedMoEMethod"
    _load(layer, ex.tensors)
    assert list(layer.named_parameters()) == []  # checkpoint copies freed
    w13, w2 = layer.moe_nvfp4_weights.to_nvfp4()
    assert torch.equal(w13.packed, ex.w13.packed) and torch.equal(w2.packed, ex.w2.packed)
    assert torch.equal(w13.block_scale.view(torch.uint8), ex.w13.block_scale.view(torch.uint8))
    # gate and up keep their own global scales, exactly (compressed-tensors: 1 / (1 / s) in float32)
    exact = dict(rtol=0, atol=0) if convention == "modelopt" else dict(rtol=1e-7, atol=0)
    torch.testing.assert_close(w13.global_scale, ex.w13.global_scale, **exact)
    assert not torch.equal(w13.global_scale[:, 0], w13.global_scale[:, 1])
    if w4a4:
        want = torch.tensor([0.5 + e / 10 for e in range(E)])
        torch.testing.assert_close(layer.quant_method.w2_input_scale, want)
        torch.testing.assert_close(layer.quant_method.w13_input_scale, want[:, None].expand(E, 2))
    x, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    ref = moe_nvfp4.fused_moe_torch(x, ex.w13, ex.w2, tw, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize(
    ("convention", "backend", "layout"),
    [
        ("modelopt", "cute", "sm100_interleaved"),
        ("compressed-tensors", "cute", "sm100_interleaved"),
        ("modelopt", None, "flashinfer_trtllm"),
    ],
)
def test_w4a4_checkpoint_runs_w4a4_where_fp4_tensor_cores_are(plugin, gen, convention, backend, layout, monkeypatch):
    """Where dispatch has a W4A4 MoE backend (sm_100/sm_103; faked here: FlashInfer's by default, ours when
    chosen) a checkpoint with input scales is laid out for that backend and apply quantizes the activations with
    each GEMM's largest input scale; the forward (the W4A4 op's CPU path, the reference on the weights unpacked
    from that layout) equals fused_moe_torch with those scales."""
    import moe_nvfp4_vllm.moe_method as method

    import moe_nvfp4
    import moe_nvfp4.api as api
    import moe_nvfp4.prepare_weights as prepare_weights
    from moe_nvfp4.dispatch import _select

    for module in (method, api, prepare_weights):  # the plugin, the forward, the packing
        monkeypatch.setattr(module, "select_backends", lambda device: _select("sm_100", backend))
    ex = _experts(gen, convention, w4a4=True)
    layer = _routed_experts(_config(plugin, convention, True))
    _load(layer, ex.tensors)
    weights = getattr(layer, method.WEIGHTS_ATTR)
    assert isinstance(weights, moe_nvfp4.MoEWeights) and weights.layout.name == layout
    w13, w2 = weights.to_nvfp4()
    assert torch.equal(w13.packed, ex.w13.packed) and torch.equal(w2.packed, ex.w2.packed)
    largest = torch.tensor([0.5 + (E - 1) / 10])
    for got in layer.quant_method.w4a4_input_scales:
        torch.testing.assert_close(got, largest)
    x, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    ref = moe_nvfp4.fused_moe_torch(x, ex.w13, ex.w2, tw, ids, w13_input_scale=largest, w2_input_scale=largest)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


def test_w4a4_checkpoint_stays_w4a16_on_hopper(plugin, gen, monkeypatch):
    """Without FP4 tensor cores (sm_90: no W4A4 MoE backend) the same checkpoint keeps the 16-bit-activation
    layout."""
    import moe_nvfp4_vllm.moe_method as method

    from moe_nvfp4.dispatch import _select

    monkeypatch.setattr(method, "select_backends", lambda device: _select("sm_90", None))
    layer = _routed_experts(_config(plugin, "modelopt", True))
    monkeypatch.setattr(layer.quant_method, "_warmup", lambda layer, weights: None)  # no Triton on CPU tensors
    _load(layer, _experts(gen, "modelopt", w4a4=True).tensors)
    assert getattr(layer, method.WEIGHTS_ATTR).layout.name == "sm90_fragments"
    assert layer.quant_method.w4a4_input_scales is None


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_sum_to_reference(plugin, gen, tp):
    """Each rank loads its slice of the intermediate dimension; the ranks' partial outputs sum to the whole."""
    import moe_nvfp4

    ex = _experts(gen)
    x, tw, ids = _routing(gen)
    total = torch.zeros(T, H)
    for rank in range(tp):
        layer = _routed_experts(_config(plugin, "modelopt"), tp=tp, tp_rank=rank)
        shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
        assert shapes["w13_weight"] == (E, 2 * I // tp, H // 2)
        assert shapes["w13_weight_scale"] == (E, 2 * I // tp, H // 16)
        assert shapes["w2_weight"] == (E, H, I // tp // 2)
        assert shapes["w2_weight_scale"] == (E, H, I // tp // 16)
        assert shapes["w13_weight_scale_2"] == (E, 2)
        _load(layer, ex.tensors)
        w13, w2 = layer.moe_nvfp4_weights.to_nvfp4()
        rows = slice(rank * I // tp, (rank + 1) * I // tp)
        assert torch.equal(w13.packed[:, : I // tp], ex.w13.packed[:, rows])  # gate slice
        assert torch.equal(w13.packed[:, I // tp :], ex.w13.packed[:, I:][:, rows])  # up slice
        assert torch.equal(w2.packed, ex.w2.packed[:, :, rank * I // tp // 2 : (rank + 1) * I // tp // 2])
        total += layer.quant_method.apply(layer, x, tw, ids, None, None).float()
    ref = moe_nvfp4.fused_moe_torch(x, ex.w13, ex.w2, tw, ids)
    torch.testing.assert_close(total, ref.float(), atol=1e-4, rtol=3e-2)


def test_expert_parallel_uses_expert_map(plugin, gen):
    import moe_nvfp4

    ex = _experts(gen)
    x, tw, ids = _routing(gen)
    total = torch.zeros(T, H)
    for rank in range(2):
        layer = _routed_experts(_config(plugin, "modelopt"), ep=2, ep_rank=rank)
        assert layer.expert_map is not None
        _load(layer, ex.tensors)
        assert layer.moe_nvfp4_weights.num_experts == E // 2
        total += layer.quant_method.apply(layer, x, tw, ids, None, None).float()
    ref = moe_nvfp4.fused_moe_torch(x, ex.w13, ex.w2, tw, ids)
    torch.testing.assert_close(total, ref.float(), atol=1e-4, rtol=3e-2)


def test_kernels_are_warmed_once_per_shape_up_to_the_token_budget(plugin, gen, monkeypatch):
    """process_weights_after_loading compiles the kernels for the scheduler's whole token budget, once per
    process and shape (same-shaped layers share the compiled kernels); an expert map is a new variant, and so is
    the router weight on the input (Llama-4), which the warm-up is told, and so is the W4A8 mode, whose e4m3 copy
    the warm-up forwards get (its kernels compile at load too, not in the first prefill)."""
    from moe_nvfp4_vllm import moe_method
    from vllm.config import DeviceConfig, VllmConfig

    import moe_nvfp4

    calls = []

    def warm(
        w, k, dtype, tokens, *, forward, expert_map=None, apply_router_weight_on_input=False, fp8_weights, threads
    ):
        assert forward is moe_nvfp4.fused_moe and threads >= 1  # what serving runs, in the configured threads
        assert fp8_weights is None or fp8_weights.source is w
        on_input = apply_router_weight_on_input
        calls.append((w.num_experts, k, dtype, tokens, expert_map is None, on_input, fp8_weights is not None))
        return []

    monkeypatch.setattr(moe_method, "_WARMED", set())
    monkeypatch.setattr(moe_method, "compile_kernels", warm)
    budget = VllmConfig(device_config=DeviceConfig(device="cpu")).scheduler_config.max_num_batched_tokens
    ex = _experts(gen)
    for _ in range(2):
        _load(_routed_experts(_config(plugin, "modelopt")), ex.tensors)
    assert calls == [(E, TOPK, torch.bfloat16, budget, True, False, False)]
    _load(_routed_experts(_config(plugin, "modelopt"), ep=2, ep_rank=0), ex.tensors)
    assert calls[1:] == [(E // 2, TOPK, torch.bfloat16, budget, False, False, False)]
    _load(_routed_experts(_config(plugin, "modelopt"), router_weight_on_input=True), ex.tensors)
    assert calls[2:] == [(E, TOPK, torch.bfloat16, budget, True, True, False)]
    monkeypatch.setenv(plugin.FP8_ACTIVATIONS_ENV, "1")
    ex = _experts(gen, "modelopt")  # the loads above packed into the last checkpoint tensors' memory
    for _ in range(2):
        _load(_routed_experts(_config(plugin, "modelopt")), ex.tensors)
    assert calls[3:] == [(E, TOPK, torch.bfloat16, budget, True, False, True)]


def test_configs_are_chosen_once_per_shape_before_the_warmup_without_autotuning(plugin, gen, monkeypatch):
    """Since issue 53 the load step takes the configs `moe-nvfp4 tune` cached (moe_nvfp4.load_moe_configs, the
    backend's autotune.load_configs: no timing unless MOE_NVFP4_AUTOTUNE=1, tested in test_autotune.py) instead of
    autotuning: once per process and shape, before the warm-up compiles what it chose, with the scheduler's token
    budget and the layer's expert map."""
    from moe_nvfp4_vllm import moe_method
    from vllm.config import DeviceConfig, VllmConfig

    import moe_nvfp4

    from moe_nvfp4.shapes import CPU_TRAITS
    from moe_nvfp4.sm90.autotune import AutotuneReport

    steps = []

    def configs(w, k, dtype, tokens, expert_map=None):
        steps.append(("configs", w.num_experts, k, dtype, tokens, None if expert_map is None else expert_map.numel()))
        return AutotuneReport(w.layer_shape(k, dtype, expert_map), CPU_TRAITS, [], 0.0, "cpu")

    monkeypatch.delenv("MOE_NVFP4_AUTOTUNE", raising=False)
    monkeypatch.setattr(moe_method, "_WARMED", set())
    monkeypatch.setattr(moe_nvfp4, "load_moe_configs", configs)
    monkeypatch.setattr(moe_method, "compile_kernels", lambda w, *a, **k: steps.append(("warm", w.num_experts)) or [])
    assert not hasattr(moe_method, "autotune_fused_moe")  # the plugin reaches the autotuner only through the API
    budget = VllmConfig(device_config=DeviceConfig(device="cpu")).scheduler_config.max_num_batched_tokens
    ex = _experts(gen)
    for _ in range(2):
        _load(_routed_experts(_config(plugin, "modelopt")), ex.tensors)
    assert steps == [("configs", E, TOPK, torch.bfloat16, budget, None), ("warm", E)]
    _load(_routed_experts(_config(plugin, "modelopt"), ep=2, ep_rank=0), ex.tensors)
    assert steps[2:] == [("configs", E // 2, TOPK, torch.bfloat16, budget, E), ("warm", E // 2)]


def test_bf16_checkpoint_is_quantized_on_load(plugin, gen):
    """Plain BF16 experts: quantized expert by expert, gate and up with their own global scales."""
    import moe_nvfp4

    ex = _experts(gen)
    tensors = {}
    for e in range(E):
        tensors[f"{e}.gate_proj.weight"] = ex.dense13[e, :I]
        tensors[f"{e}.up_proj.weight"] = ex.dense13[e, I:]
        tensors[f"{e}.down_proj.weight"] = ex.dense2[e]
    layer = _routed_experts(_config(plugin, None), tp=2, tp_rank=1)
    _load(layer, tensors)
    w13, w2 = layer.moe_nvfp4_weights.to_nvfp4()
    half = slice(I // 2, I)
    want13 = moe_nvfp4.quantize_nvfp4(
        torch.cat([ex.dense13[:, :I][:, half], ex.dense13[:, I:][:, half]], 1).float(), segments=2
    )
    want2 = moe_nvfp4.quantize_nvfp4(ex.dense2[:, :, half].float())
    assert torch.equal(w13.packed, want13.packed) and torch.equal(w2.packed, want2.packed)
    assert torch.equal(w13.global_scale, want13.global_scale)
    x, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    ref = moe_nvfp4.fused_moe_torch(x, want13, want2, tw, ids)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize("big_id", [2**32 + 1, 2**40], ids=["wraps onto expert 1", "wraps onto expert 0"])
def test_router_ids_reach_the_api_uncast(plugin, gen, big_id):
    """vLLM's int64 ids and bf16 weights go to the API as they come, which casts once: an id past int32 saturates
    out of range (its pair contributes nothing) where a plain int32 cast would wrap it onto an expert."""
    import moe_nvfp4

    ex = _experts(gen)
    layer = _routed_experts(_config(plugin, "modelopt"))
    _load(layer, ex.tensors)
    x, tw, ids = _routing(gen)
    wrapped = ids.long()
    wrapped[0, 0] = big_id
    out = layer.quant_method.apply(layer, x, tw.bfloat16(), wrapped, None, None)
    dropped = ids.clone()
    dropped[0, 0] = -1  # routed nowhere (routing.routed_pairs)
    ref = moe_nvfp4.fused_moe_torch(x, ex.w13, ex.w2, tw.bfloat16().float(), dropped)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


def test_zero_tokens(plugin, gen):
    ex = _experts(gen)
    layer = _routed_experts(_config(plugin, "modelopt"))
    _load(layer, ex.tensors)
    x, tw, ids = _routing(gen, t=0)
    assert layer.quant_method.apply(layer, x, tw, ids, None, None).shape == (0, H)


# ---------------------------------------------------------------- families: NemotronH, Llama-4, gpt-oss

# An fp32 reference from the dequantized experts, written out here rather than taken from moe_nvfp4: the kernel's
# intermediate activation is rounded to bf16, so ||out - ref|| / ||ref|| stays near 2^-8; FAMILY_REL_TOL is 4x that.
FAMILY_REL_TOL = 1.6e-2
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's, vLLM's swigluoai_and_mul defaults


def _moe_reference(x, w13, w2, tw, ids, activation, *, b13=None, b2=None, on_input=False):
    """x [T, H]; w13 [E, S*I, H] float (gate rows then up rows, or one projection), w2 [E, H, I]; biases [E, S*I] / [E, H]."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), float(tw[t, j])
            xi = x[t].float() * (w if on_input else 1.0)
            h = w13[e] @ xi + (0 if b13 is None else b13[e].float())
            if activation == "relu2":
                a = torch.relu(h) ** 2
            else:
                g, u = h.chunk(2)
                if activation == "silu":
                    a = torch.nn.functional.silu(g) * u
                else:  # swiglu_oai, as vLLM's swigluoai_and_mul on de-interleaved halves
                    g, u = g.clamp(max=SWIGLU_LIMIT), u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
                    a = (u + 1) * g * torch.sigmoid(SWIGLU_ALPHA * g)
            y = w2[e] @ a + (0 if b2 is None else b2[e].float())
            out[t] += y * (1.0 if on_input else w)
    return out


def _rel(out, ref):
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))


def _checkpoint_names(convention):
    if convention == "compressed-tensors":
        return "weight_packed", "weight_scale", "weight_global_scale"
    return ("weight", "weight_scale", "weight_scale_2") if convention == "modelopt" else ("weight",)


def _projection_tensors(gen, convention, projections: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Per-expert checkpoint tensors of each projection name -> dense [E, N, K]; returns (tensors, dequantized
    [E, N, K] float per projection).  BF16 checkpoints: the dense values themselves (quantized on load)."""
    import moe_nvfp4

    names = _checkpoint_names(convention)
    tensors, deq = {}, {}
    for proj, dense in projections.items():
        if convention is None:
            tensors.update({f"{e}.{proj}.weight": dense[e].bfloat16() for e in range(E)})
            deq[proj] = moe_nvfp4.dequantize_nvfp4(moe_nvfp4.quantize_nvfp4(dense.bfloat16().float()))
            continue
        q = moe_nvfp4.quantize_nvfp4(dense)
        for e in range(E):
            gs = q.global_scale[e]
            tensors[f"{e}.{proj}.{names[0]}"] = q.packed[e].clone()
            tensors[f"{e}.{proj}.{names[1]}"] = q.block_scale[e].clone()
            tensors[f"{e}.{proj}.{names[2]}"] = (1.0 / gs if convention == "compressed-tensors" else gs).reshape(())
        deq[proj] = moe_nvfp4.dequantize_nvfp4(q)
    return tensors, deq


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors", None], ids=["modelopt", "ct", "bf16"])
def test_nemotron_h_non_gated_relu2_experts(plugin, gen, convention):
    """NemotronH: relu2_no_mul, w13 is the one up_proj (vLLM's shard w1, I rows), loaded by its checkpoint names."""
    from moe_nvfp4.expert_activation import RELU2

    up = torch.randn(E, I, H, generator=gen) * 0.05
    down = torch.randn(E, H, I, generator=gen) * 0.05
    tensors, deq = _projection_tensors(gen, convention, {"up_proj": up, "down_proj": down})
    layer = _routed_experts(_config(plugin, convention), activation="relu2_no_mul")
    w13_rows = {n: p.shape[1] for n, p in layer.named_parameters() if n.startswith("w13_") and p.dim() == 3}
    assert w13_rows and set(w13_rows.values()) == {I}  # one projection of I rows, not gate + up
    _load(layer, tensors)
    weights = layer.moe_nvfp4_weights
    assert weights.activation == RELU2
    x, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    ref = _moe_reference(x, deq["up_proj"], deq["down_proj"], tw, ids, "relu2")
    assert out.shape == (T, H) and _rel(out, ref) <= FAMILY_REL_TOL


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors", None], ids=["modelopt", "ct", "bf16"])
def test_llama4_router_weight_applied_to_the_input(plugin, gen, convention):
    """Llama-4: top-1 sigmoid routing, the router weight scales the expert's input (not its output).  The BF16
    form loads as vLLM's Llama-4 loader hands over its stacked [E, H, 2I] / [E, I, H] tensors: transposed, gate
    and up chunks, all experts in one call."""
    gate, upp = torch.randn(E, I, H, generator=gen) * 0.05, torch.randn(E, I, H, generator=gen) * 0.05
    down = torch.randn(E, H, I, generator=gen) * 0.05
    tensors, deq = _projection_tensors(gen, convention, {"gate_proj": gate, "up_proj": upp, "down_proj": down})
    layer = _routed_experts(_config(plugin, convention), top_k=1, router_weight_on_input=True)
    if convention is None:
        stacked_gate_up = torch.cat([gate, upp], 1).transpose(1, 2).bfloat16()  # Llama-4's [E, H, 2I]
        w13 = stacked_gate_up.transpose(-1, -2).chunk(2, dim=-2)  # what Llama4Model.load_moe_expert_weights passes
        for shard, t in zip(("w1", "w3"), w13):
            layer.w13_weight.weight_loader(layer.w13_weight, t, "w13_weight", shard_id=shard, expert_id=0)
        layer.w2_weight.weight_loader(
            layer.w2_weight, down.transpose(1, 2).bfloat16().transpose(-1, -2), "w2_weight", shard_id="w2", expert_id=0
        )
        layer.quant_method.process_weights_after_loading(layer)
    else:
        _load(layer, tensors)
    x = torch.randn(T, H, generator=gen).bfloat16()
    tw, ids = torch.topk(torch.randn(T, E, generator=gen).sigmoid(), 1, dim=-1)  # not renormalized: weights < 1
    out = layer.quant_method.apply(layer, x, tw.float(), ids.int(), None, None)
    w13_deq = torch.cat([deq["gate_proj"], deq["up_proj"]], 1)
    ref = _moe_reference(x, w13_deq, deq["down_proj"], tw, ids, "silu", on_input=True)
    on_output = _moe_reference(x, w13_deq, deq["down_proj"], tw, ids, "silu")
    assert _rel(on_output, ref) > 10 * FAMILY_REL_TOL  # the test tells input from output weighting
    assert _rel(out, ref) <= FAMILY_REL_TOL


def _interleave(gate_rows, up_rows):
    """[E, I, ...] gate and up -> [E, 2I, ...] with row 2i gate i, row 2i + 1 up i (vLLM's swigluoai layout)."""
    return torch.stack([gate_rows, up_rows], 2).flatten(1, 2)


def _gpt_oss_layer(plugin, gen, *, tp=1, tp_rank=0):
    """A gpt-oss expert layer loaded as GptOssForCausalLM._load_weights_other does: its stacked BF16 tensors and
    biases copied into the parameters (interleaved gate/up, this rank's columns), past every weight loader."""
    gate, upp = torch.randn(E, I, H, generator=gen) * 0.05, torch.randn(E, I, H, generator=gen) * 0.05
    down = torch.randn(E, H, I, generator=gen) * 0.05
    b_gate, b_up, b_down = (torch.randn(E, n, generator=gen) * 0.5 for n in (I, I, H))
    layer = _routed_experts(_config(plugin, None), activation="swigluoai", has_bias=True, tp=tp, tp_rank=tp_rank)
    cols = slice(tp_rank * I // tp, (tp_rank + 1) * I // tp)
    with torch.no_grad():
        layer.w13_weight.copy_(_interleave(gate[:, cols], upp[:, cols]).bfloat16())
        layer.w13_bias.copy_(_interleave(b_gate[:, cols], b_up[:, cols]).bfloat16())
        layer.w2_weight.copy_(down[:, :, cols].bfloat16())
        layer.w2_bias.copy_(b_down.bfloat16() if tp_rank == 0 else torch.zeros(E, H))  # rank 0 adds it
    dense = {"gate": gate[:, cols], "up": upp[:, cols], "down": down[:, :, cols]}
    biases = {"gate": b_gate[:, cols].bfloat16(), "up": b_up[:, cols].bfloat16(), "down": b_down.bfloat16()}
    return layer, dense, biases


def test_gpt_oss_experts_deinterleaved_with_biases(plugin, gen):
    """gpt-oss (BF16 checkpoint quantized on load): interleaved w13 rows and biases land gate-then-up, biases on
    both GEMMs, swigluoai's clamp active (inputs large enough that |gate| > 7 occurs)."""
    import moe_nvfp4

    layer, dense, biases = _gpt_oss_layer(plugin, gen)
    layer.quant_method.process_weights_after_loading(layer)
    weights = layer.moe_nvfp4_weights
    assert weights.activation.name == "swiglu_oai"
    w13, w2 = weights.to_nvfp4()
    want13 = moe_nvfp4.quantize_nvfp4(torch.cat([dense["gate"], dense["up"]], 1).bfloat16().float(), segments=2)
    assert torch.equal(w13.packed, want13.packed) and torch.equal(w13.global_scale, want13.global_scale)
    assert torch.equal(weights.w13_bias.float(), torch.cat([biases["gate"], biases["up"]], 1).float())
    assert torch.equal(weights.w2_bias.float(), biases["down"].float())
    x = (torch.randn(T, H, generator=gen) * 40).bfloat16()
    _, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    w13_deq = moe_nvfp4.dequantize_nvfp4(want13)
    w2_deq = moe_nvfp4.dequantize_nvfp4(moe_nvfp4.quantize_nvfp4(dense["down"].bfloat16().float()))
    b13 = torch.cat([biases["gate"], biases["up"]], 1)
    h = torch.einsum("th,enh->ten", x.float(), w13_deq)[:, :, :I] + biases["gate"].float()
    assert bool((h > SWIGLU_LIMIT).any()), "the clamp never engages; the test would not see it"
    ref = _moe_reference(x, w13_deq, w2_deq, tw, ids, "swiglu_oai", b13=b13, b2=biases["down"])
    assert _rel(out, ref) <= FAMILY_REL_TOL


def test_gpt_oss_tensor_parallel_ranks_sum_to_reference(plugin, gen):
    """TP=2: each rank holds its interleaved columns; only rank 0 holds the down bias; the sum is the model."""
    import moe_nvfp4

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    x, tw, ids = _routing(gen)
    total, refs = 0, 0
    for rank in range(2):
        # both ranks draw the same full model and keep their columns of it
        layer, dense, biases = _gpt_oss_layer(plugin, torch.Generator().manual_seed(seed), tp=2, tp_rank=rank)
        layer.quant_method.process_weights_after_loading(layer)
        total = total + layer.quant_method.apply(layer, x, tw, ids, None, None).float()
        w13_deq = moe_nvfp4.dequantize_nvfp4(
            moe_nvfp4.quantize_nvfp4(torch.cat([dense["gate"], dense["up"]], 1).bfloat16().float(), segments=2)
        )
        w2_deq = moe_nvfp4.dequantize_nvfp4(moe_nvfp4.quantize_nvfp4(dense["down"].bfloat16().float()))
        refs = refs + _moe_reference(
            x,
            w13_deq,
            w2_deq,
            tw,
            ids,
            "swiglu_oai",
            b13=torch.cat([biases["gate"], biases["up"]], 1),
            b2=biases["down"] if rank == 0 else None,
        )
    assert _rel(total, refs) <= FAMILY_REL_TOL


def test_gpt_oss_bias_never_written_is_named(plugin, gen):
    from moe_nvfp4.checkpoint import CheckpointError

    layer, _, _ = _gpt_oss_layer(plugin, gen)
    with torch.no_grad():
        layer.w2_bias[2].fill_(float("nan"))  # expert 2's down bias never arrived
    with pytest.raises(CheckpointError, match=rf"{LAYER}: expert 2 down_proj.bias was never loaded"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize(
    ("activation", "swiglu", "match"),
    [
        ("gelu", None, "activation gelu"),
        ("silu_no_mul", None, "activation silu_no_mul"),
        ("silu", (7.0, None, None), "activation silu with swiglu limit/alpha/beta 7.0/None/None"),
        ("swigluoai", (7.0, 1.702, 1.0), "activation swigluoai with swiglu limit/alpha/beta 7.0/1.702/1.0"),
    ],
    ids=["gelu", "non-gated-silu", "clamped-silu", "swiglu-beta"],
)
def test_unsupported_activations_are_rejected_naming_the_layer(plugin, activation, swiglu, match):
    with pytest.raises(NotImplementedError, match=rf"{LAYER}: nvfp4_grouped does not support {match}"):
        _routed_experts(_config(plugin, "modelopt"), activation=activation, swiglu=swiglu)


# ---------------------------------------------------------------- validation errors


def _corrupt(name, value):
    def f(tensors):
        tensors[name] = value(tensors[name]) if callable(value) else value

    return f


def _drop(name):
    def f(tensors):
        del tensors[name]

    return f


@dataclass(frozen=True)
class BadCase:
    why: str
    edit: object
    match: str
    convention: str = "modelopt"
    w4a4: bool = False


def _nan_scale(t):
    t = t.clone()
    t.view(torch.uint8)[3, 1] = 0x7F  # e4m3 NaN
    return t


def _negative_scale(t):
    return (-t.float()).to(torch.float8_e4m3fn)


BAD_CASES = [
    BadCase(
        "missing up global scale (never loaded)",
        _drop("2.up_proj.weight_scale_2"),
        r"experts\.2\.up_proj\.weight_scale_2 \(expert 2\): missing",
    ),
    BadCase(
        "missing packed down weight",
        _drop("1.down_proj.weight"),
        r"experts\.1\.down_proj\.weight \(expert 1\): missing",
    ),
    BadCase(
        "missing block scale",
        _drop("3.gate_proj.weight_scale"),
        r"experts\.3\.gate_proj\.weight_scale \(expert 3\): missing",
    ),
    BadCase(
        "W4A4 without an input scale",
        _drop("0.down_proj.input_scale"),
        r"experts\.0\.down_proj\.input_scale \(expert 0\): missing.*W4A4",
        w4a4=True,
    ),
    BadCase(
        "NaN block scale",
        _corrupt("2.up_proj.weight_scale", _nan_scale),
        r"up_proj.weight_scale \(expert 2\): 1 block scales are NaN",
    ),
    BadCase(
        "negative block scales",
        _corrupt("1.down_proj.weight_scale", _negative_scale),
        r"down_proj.weight_scale \(expert 1\): \d+ block scales are negative",
    ),
    BadCase(
        "zero global scale",
        _corrupt("3.gate_proj.weight_scale_2", torch.tensor(0.0)),
        r"gate_proj.weight_scale_2 \(expert 3\): scale must be finite and positive",
    ),
    BadCase(
        "inf global scale",
        _corrupt("0.down_proj.weight_scale_2", torch.tensor(math.inf)),
        r"down_proj.weight_scale_2 \(expert 0\): scale must be finite and positive",
    ),
    BadCase(
        "negative input scale",
        _corrupt("2.up_proj.input_scale", torch.tensor(-1.0)),
        r"up_proj.input_scale \(expert 2\): scale must be finite and positive",
        w4a4=True,
    ),
    BadCase(
        "NaN input scale, compressed-tensors",
        _corrupt("1.gate_proj.input_global_scale", torch.tensor(math.nan)),
        r"gate_proj.input_global_scale \(expert 1\): scale must be finite and positive as a multiplier",
        "compressed-tensors",
        True,
    ),
    BadCase(
        "negative CT global scale",
        _corrupt("2.down_proj.weight_global_scale", torch.tensor(-3.0)),
        r"down_proj.weight_global_scale \(expert 2\): scale must be finite and positive",
        "compressed-tensors",
    ),
    BadCase(
        "block scale stored as float32",
        _corrupt("1.up_proj.weight_scale", lambda t: t.float()),
        r"expert 1 up_proj.weight_scale: dtype torch.float32, expected torch.float8_e4m3fn",
    ),
    BadCase(
        "packed weight stored as int8",
        _corrupt("0.gate_proj.weight", lambda t: t.view(torch.int8)),
        r"expert 0 gate_proj.weight: dtype torch.int8, expected torch.uint8",
    ),
    BadCase(
        "unpacked (wrong shape) weight",
        _corrupt("3.down_proj.weight", lambda t: torch.zeros(H, I, dtype=torch.uint8)),
        r"expert 3 down_proj.weight: shape \(64, 64\), expected \(64, 32\)",
    ),
    BadCase(
        "global scale is a vector",
        _corrupt("1.gate_proj.weight_scale_2", torch.ones(2)),
        r"expert 1 gate_proj.weight_scale_2: expected a scalar, got shape \(2,\)",
    ),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.why)
def test_validation_errors_name_layer_expert_and_tensor(plugin, gen, case):
    from moe_nvfp4.checkpoint import CheckpointError

    ex = _experts(gen, case.convention, w4a4=case.w4a4)
    case.edit(ex.tensors)
    layer = _routed_experts(_config(plugin, case.convention, case.w4a4))
    with pytest.raises(CheckpointError, match=case.match) as info:
        _load(layer, ex.tensors)
    assert LAYER in str(info.value)


def test_bf16_nan_weight_is_reported(plugin, gen):
    from moe_nvfp4.checkpoint import CheckpointError

    ex = _experts(gen)
    tensors = {
        f"{e}.{p}.weight": w
        for e in range(E)
        for p, w in (
            ("gate_proj", ex.dense13[e, :I]),
            ("up_proj", ex.dense13[e, I:].clone()),
            ("down_proj", ex.dense2[e]),
        )
    }
    tensors["2.up_proj.weight"][5, 7] = math.nan
    layer = _routed_experts(_config(plugin, None))
    with pytest.raises(CheckpointError, match=rf"{LAYER}: expert 2 up_proj.weight holds NaN or inf"):
        _load(layer, tensors)


@pytest.mark.parametrize("tp, inter", [(2, 48), (4, 64)], ids=["24-per-rank", "16-per-rank-ok"])
def test_tp_that_splits_a_scale_block_is_rejected_at_create_weights(plugin, tp, inter):
    qc = _config(plugin, "modelopt")
    if inter // tp % 16 == 0:
        _routed_experts(qc, tp=tp, inter=inter)
        return
    with pytest.raises(
        ValueError, match=r"intermediate size 48 split over tensor parallel size 2 gives 24 per rank.*multiple of 16"
    ):
        _routed_experts(qc, tp=tp, inter=inter)


def test_excluded_experts_stay_unquantized(plugin):
    cfg = {**MODELOPT_W4A16, "ignore": ["model.layers.0.mlp.experts"]}
    qc = plugin.NVFP4GroupedConfig.from_config(cfg)
    assert qc._experts_excluded(None, LAYER)
    assert not qc._experts_excluded(None, "model.layers.1.mlp.experts")


# ---------------------------------------------------------------- what differs between vLLM releases


def _release():
    """The installed vLLM's (major, minor); None without vLLM (the module's tests then skip, but skipif
    conditions are evaluated at collection, before that)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from moe_nvfp4_vllm import compat

    return compat.VLLM_RELEASE


def test_installed_vllm_is_a_supported_release():
    """CI installs exactly the releases compat names; a third one would run these tests against untested paths."""
    from moe_nvfp4_vllm import compat

    assert _release() in ((0, 26), (0, 33)) and compat.is_supported()


def test_pyproject_admits_exactly_the_supported_releases():
    """pip install 'moe-nvfp4[vllm]' must resolve to a release compat supports, and to every one of them."""
    from pathlib import Path

    import tomllib
    from moe_nvfp4_vllm import compat
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (req,) = [Requirement(r) for r in project["optional-dependencies"]["vllm"]]
    admitted = {(0, minor) for minor in range(20, 40) for patch in (0, 3) if f"0.{minor}.{patch}" in req.specifier}
    assert admitted == set(compat.RELEASES)


def test_unsupported_release_is_refused_by_name(plugin, monkeypatch, caplog):
    """Another release: building the config raises an error naming the supported ones; the entry point (run in
    every vLLM process, asked for nvfp4_grouped or not) logs that and registers nothing instead of raising."""
    import logging

    from moe_nvfp4_vllm import compat
    from moe_nvfp4_vllm.plugin import register
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG

    monkeypatch.setattr(compat, "VLLM_RELEASE", (0, 31))
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.26\.x .* or 0\.33\.x .*; this is vLLM"):
        plugin.NVFP4GroupedConfig()
    with pytest.raises(RuntimeError, match=r"0\.26\.x"):
        plugin.NVFP4GroupedConfig.from_config(dict(MODELOPT_W4A16))
    monkeypatch.delitem(_CUSTOMIZED_METHOD_TO_QUANT_CONFIG, "nvfp4_grouped")
    logging.getLogger("vllm").addHandler(caplog.handler)  # vLLM's logger does not propagate to the root
    try:
        register()
    finally:
        logging.getLogger("vllm").removeHandler(caplog.handler)
    assert "nvfp4_grouped" not in _CUSTOMIZED_METHOD_TO_QUANT_CONFIG
    assert "nvfp4_grouped is not registered: it supports vLLM 0.26.x" in caplog.text


def test_is_mxfp4_quant_is_not_ours_to_answer(plugin):
    """0.26's MoE layer asks QuantizationConfig.is_mxfp4_quant before rounding the hidden size (the base says
    False, which is right for us); 0.33 removed the hook, so an override of ours would be dead code."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    assert "is_mxfp4_quant" not in vars(plugin.NVFP4GroupedConfig)
    if _release() == (0, 26):
        assert plugin.NVFP4GroupedConfig().is_mxfp4_quant(LAYER, None) is False
    else:
        assert not hasattr(QuantizationConfig, "is_mxfp4_quant")


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors", None], ids=["modelopt", "ct", "bf16"])
def test_layer_gets_our_method_through_vllms_own_lookup(plugin, convention):
    """RoutedExperts asks the config for its method: 0.26 calls get_quant_method directly, 0.33 through
    resolve_quant_method (which keeps the checkpoint's method when no online quantization is configured)."""
    layer = _routed_experts(_config(plugin, convention))
    assert type(layer.quant_method).__name__ == "NVFP4GroupedMoEMethod"
    assert not layer.quant_method.is_monolithic  # the runner routes first, then calls apply
    if _release() == (0, 33):
        from vllm.model_executor.layers.quantization.base_config import resolve_quant_method

        again = resolve_quant_method(layer.quant_config, layer, LAYER)
        assert type(again).__name__ == "NVFP4GroupedMoEMethod"


@pytest.mark.skipif(_release() != (0, 33), reason="vLLM 0.26 has no online requantization (resolve_quant_method)")
def test_online_requantization_is_refused(plugin):
    """0.33 would make our method the source of an online requantization (it needs dequantize_weight, which
    NVFP4 experts have no business offering); the config refuses by name instead of failing at load."""
    from vllm.config.quantization import QuantizationConfigArgs
    from vllm.model_executor.layers.quantization.base_config import resolve_quant_method
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    qc = _config(plugin, "modelopt")
    fp8 = "fp8_per_tensor_dynamic"
    qc.online_quantization_config = OnlineQuantizationConfig(QuantizationConfigArgs(linear=fp8, moe=fp8))
    layer_prefix = "model.layers.0.self_attn.o_proj"
    with pytest.raises(ValueError, match=rf"{layer_prefix}: nvfp4_grouped does not combine with online quantization"):
        resolve_quant_method(qc, torch.nn.Linear(2, 2), layer_prefix)


def test_dense_layers_get_vllms_modelopt_linear_method_of_this_release(plugin):
    """Non-expert NVFP4 layers are delegated to ModelOptNvFp4Config, whose linear methods 0.33 replaced with the
    generic ModelOptLinearMethod(spec, ctx, format_scheme); excluded layers stay unquantized in both."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    class FakeLinear(LinearBase):  # get_quant_method only looks at the type
        def __init__(self):
            torch.nn.Module.__init__(self)

    for cfg, w4a4 in ((MODELOPT_W4A16, False), (MODELOPT_W4A4, True)):
        qc = plugin.NVFP4GroupedConfig.from_config(dict(cfg))
        assert isinstance(qc.get_quant_method(FakeLinear(), "lm_head"), UnquantizedLinearMethod)
        if _release() == (0, 26):  # the 0.26 classes pick a GPU kernel in __init__: check which class it is
            want = "ModelOptNvFp4LinearMethod" if w4a4 else "ModelOptNvFp4W4A16LinearMethod"
            assert qc.delegate.LinearMethodCls.__name__ == want
            continue
        from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

        method = qc.get_quant_method(FakeLinear(), "model.layers.0.self_attn.o_proj")
        assert type(method).__name__ == "ModelOptLinearMethod"
        assert method.spec.weight == kNvfp4Static and (method.spec.activation is not None) == w4a4


def test_no_prepare_finalize_for_all2all_backends(plugin, monkeypatch):
    """0.26's runner asks the method for a prepare/finalize after loading and wraps it in FusedMoEModularMethod;
    under DP + EP with DeepEP the base method would build one around modular experts we do not have, so ours
    answers None (the runner then keeps its naive dispatch/combine).  0.33 removed the hook and the wrapping."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    layer = _routed_experts(_config(plugin, "modelopt"), ep=2, ep_rank=0)
    method = layer.quant_method
    if _release() == (0, 33):
        assert not hasattr(FusedMoEMethodBase, "maybe_make_prepare_finalize")
        assert not hasattr(method, "maybe_make_prepare_finalize") and not hasattr(method, "select_gemm_impl")
        return
    deepep = dataclasses.replace(method.moe.moe_parallel_config, dp_size=2, all2all_backend="deepep_low_latency")
    monkeypatch.setattr(method.moe, "moe_parallel_config", deepep)
    assert method.moe.use_deepep_ll_kernels
    assert method.maybe_make_prepare_finalize(routing_tables=None) is None


def test_expert_map_is_the_local_slot_map(plugin, gen):
    """Under EP our kernel takes the -1 / local-slot expert map.  0.33's RoutedExperts.expert_map hands a 0/1
    mask instead to experts that set consumes_expert_mask; ours have no moe_kernel, so they get the map."""
    layer = _routed_experts(_config(plugin, "modelopt"), ep=2, ep_rank=1)
    assert layer.expert_map.tolist() == [-1, -1, 0, 1]
    assert layer.quant_method.moe_kernel is None


@pytest.mark.skipif(_release() != (0, 33), reason="vLLM 0.26 has no deferred MoE finalize")
def test_deferred_finalize_is_declined(plugin, gen):
    """0.33 lets a model ask for an UnfinalizedMoEOutput (defer_moe_finalize) and then trust
    should_defer_moe_finalize for each call; our apply always returns the finished sum, so the answer is no."""
    import moe_nvfp4

    ex = _experts(gen)
    layer = _routed_experts(_config(plugin, "modelopt"), tp=2, tp_rank=0)
    layer.moe_config.defer_moe_finalize(64)
    assert layer.moe_config.use_deferred_moe_finalize  # a TP-only layer: vLLM would defer for TRTLLM experts
    assert not any(layer.moe_config.should_defer_moe_finalize(n) for n in (1, T, 64, 4096))
    _load(layer, ex.tensors)
    x, tw, ids = _routing(gen)
    out = layer.quant_method.apply(layer, x, tw, ids, None, None)
    assert type(out) is torch.Tensor  # finished, not an UnfinalizedMoEOutput
    rows = torch.cat([torch.arange(I // 2), I + torch.arange(I // 2)])  # rank 0: the first half of gate and of up
    w13 = moe_nvfp4.NVFP4Tensor(ex.w13.packed[:, rows], ex.w13.block_scale[:, rows], ex.w13.global_scale)
    w2 = moe_nvfp4.NVFP4Tensor(ex.w2.packed[..., : I // 4], ex.w2.block_scale[..., : I // 32], ex.w2.global_scale)
    ref = moe_nvfp4.fused_moe_torch(x, w13, w2, tw, ids)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


# ---------------------------------------------------------------- the whole MoE layer: vLLM's factory and runner


@pytest.fixture(scope="module")
def single_process_group(tmp_path_factory):
    """vLLM's MoE factory reads the TP / EP / DP groups: one CPU process of world size 1 (gloo)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init = f"file://{tmp_path_factory.mktemp('dist') / 'init'}"
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            parallel_state.init_distributed_environment(1, 0, init, 0, "gloo")
            parallel_state.initialize_model_parallel(1, 1)
    yield


def _moe_layer(qc):
    """vLLM's own MoE layer (0.26 ``FusedMoE``, 0.33 ``FusedMoEFactory``: the same factory, renamed): router,
    MoERunner and RoutedExperts, with a torch softmax top-k router (vLLM's fused top-k is a CUDA op)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import layer as moe_layer

    factory = moe_layer.FusedMoE if _release() == (0, 26) else moe_layer.FusedMoEFactory

    def route(hidden_states, gating_output, topk, renormalize):
        tw, ids = torch.topk(gating_output.float().softmax(-1), topk, dim=-1)
        return tw / tw.sum(-1, keepdim=True), ids.int()

    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config):
        layer = factory(
            num_experts=E,
            top_k=TOPK,
            hidden_size=H,
            intermediate_size=I,
            params_dtype=torch.bfloat16,
            renormalize=True,
            custom_routing_function=route,
            quant_config=qc,
            prefix=LAYER,
        )
    return layer, vllm_config


def _bf16_tensors(ex):
    tensors = {}
    for e in range(E):
        tensors[f"{e}.gate_proj.weight"] = ex.dense13[e, :I]
        tensors[f"{e}.up_proj.weight"] = ex.dense13[e, I:]
        tensors[f"{e}.down_proj.weight"] = ex.dense2[e]
    return tensors


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors", None], ids=["modelopt", "ct", "bf16"])
def test_moe_runner_forward_calls_our_apply(plugin, gen, single_process_group, convention, monkeypatch):
    """The path a served model takes: the runner's load_weights, process_weights_after_loading, then forward
    (router -> RoutedExperts.forward_modular -> our apply, not apply_monolithic) inside a forward context; the
    output equals fused_moe_torch on the checkpoint's NVFP4 values (BF16: the same values quantized on load).
    0.26 also runs its legacy modular-kernel setup, which must leave our method in place."""
    from vllm.forward_context import set_forward_context

    import moe_nvfp4

    ex = _experts(gen, convention or "modelopt")
    layer, vllm_config = _moe_layer(_config(plugin, convention))
    method = layer.routed_experts.quant_method
    assert type(method).__name__ == "NVFP4GroupedMoEMethod"
    list(layer.load_weights(iter(sorted((ex.tensors if convention else _bf16_tensors(ex)).items()))))
    method.process_weights_after_loading(layer.routed_experts)
    if _release() == (0, 26):
        layer.maybe_init_modular_kernel()
        assert layer.routed_experts.quant_method is method  # no FusedMoEModularMethod wrapped around it
    calls = []
    monkeypatch.setattr(method, "apply", lambda *a, **k: calls.append(k or a) or type(method).apply(method, *a, **k))
    x = torch.randn(T, H, generator=gen).bfloat16()
    logits = torch.randn(T, E, generator=gen)
    with set_forward_context({}, vllm_config):
        out = layer(x, logits)
    assert len(calls) == 1
    tw, ids = torch.topk(logits.softmax(-1), TOPK, dim=-1)
    if convention:
        w13, w2 = ex.w13, ex.w2
    else:
        w13 = moe_nvfp4.quantize_nvfp4(ex.dense13.float(), segments=2)
        w2 = moe_nvfp4.quantize_nvfp4(ex.dense2.float())
    ref = moe_nvfp4.fused_moe_torch(x, w13, w2, (tw / tw.sum(-1, keepdim=True)).float(), ids.int())
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


# ---------------------------------------------------------------- converted families in vLLM's own modelopt_fp4 path


@pytest.mark.parametrize("family", ["nemotron_h", "llama4_text"])
def test_converted_family_loads_in_vllms_own_modelopt_method(plugin, single_process_group, tmp_path, family):
    """The converter's NemotronH / Llama-4 experts load through vLLM's own ModelOptNvFp4FusedMoE (``modelopt_fp4``
    without nvfp4_grouped) into exactly the checkpoint's bytes: non-gated up_proj as w13 of I rows (NemotronH),
    per-expert gate/up/down from Llama-4's stacked transposed source.  vLLM picks no NVFP4 MoE kernel on CPU, so
    its backend choice is stubbed: only loading is under test here."""
    import json as json_module
    from unittest import mock

    from helpers_checkpoints import make_tiny_checkpoint
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization import modelopt

    from moe_nvfp4.convert import convert_checkpoint

    out = tmp_path / "nvfp4"
    convert_checkpoint(make_tiny_checkpoint(family, tmp_path / "bf16"), out, progress=False)
    qc = modelopt.ModelOptNvFp4Config.from_config(
        json_module.loads((out / "config.json").read_text())["quantization_config"]
    )
    tensors = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    gated = family != "nemotron_h"
    prefix = "model.layers.0.feed_forward.experts" if gated else "backbone.layers.1.mixer.experts"
    with mock.patch.object(modelopt, "select_nvfp4_moe_backend", return_value=(None, None)):
        layer = _routed_experts(qc, activation="silu" if gated else "relu2_no_mul")
    assert type(layer.quant_method).__name__ == "ModelOptNvFp4FusedMoE"
    list(
        layer.load_weights(
            iter(sorted((k.removeprefix(prefix + "."), v) for k, v in tensors.items() if k.startswith(prefix + ".")))
        )
    )
    w13_projs = ("gate_proj", "up_proj") if gated else ("up_proj",)
    for e in range(E):
        want13 = torch.cat([tensors[f"{prefix}.{e}.{p}.weight"] for p in w13_projs])
        assert torch.equal(layer.w13_weight[e], want13) and torch.equal(
            layer.w2_weight[e], tensors[f"{prefix}.{e}.down_proj.weight"]
        )
        scale13 = torch.cat([tensors[f"{prefix}.{e}.{p}.weight_scale"].view(torch.uint8) for p in w13_projs])
        assert torch.equal(layer.w13_weight_scale[e].view(torch.uint8), scale13)
        assert layer.w13_weight_scale_2[e].tolist() == [
            float(tensors[f"{prefix}.{e}.{p}.weight_scale_2"]) for p in w13_projs
        ]


@pytest.mark.parametrize("family", ["llama4", "nemotron_h"])
def test_moe_runner_forward_family_layers(plugin, gen, single_process_group, family, monkeypatch):
    """vLLM's own factory and runner around our method for Llama-4 (top-1, router weight on the input: applied
    once, by us, not again by the runner) and NemotronH (relu2_no_mul under its checkpoint names), ModelOpt form."""
    from unittest import mock

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import config as moe_config_module
    from vllm.model_executor.layers.fused_moe import layer as moe_layer

    llama4 = family == "llama4"
    top_k = 1 if llama4 else TOPK
    projs = {"gate_proj": None, "up_proj": None, "down_proj": None} if llama4 else {"up_proj": None, "down_proj": None}
    for p in projs:
        projs[p] = torch.randn(E, H if p == "down_proj" else I, I if p == "down_proj" else H, generator=gen) * 0.05
    tensors, deq = _projection_tensors(gen, "modelopt", projs)

    def route(hidden_states, gating_output, topk, renormalize):
        return torch.topk(gating_output.float().sigmoid(), topk, dim=-1)  # Llama-4's: sigmoid, not renormalized

    factory = moe_layer.FusedMoE if _release() == (0, 26) else moe_layer.FusedMoEFactory
    extra = (
        dict(apply_router_weight_on_input=True)
        if llama4
        else dict(activation="relu2_no_mul", ckpt_names=("up_proj", "down_proj", "" if _release() == (0, 26) else None))
    )
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with (
        set_current_vllm_config(vllm_config),
        mock.patch.object(moe_config_module.current_platform, "is_cuda_alike", return_value=True),
    ):
        layer = factory(
            num_experts=E,
            top_k=top_k,
            hidden_size=H,
            intermediate_size=I,
            params_dtype=torch.bfloat16,
            renormalize=False,
            custom_routing_function=route,
            quant_config=_config(plugin, "modelopt"),
            prefix=LAYER,
            **extra,
        )
    method = layer.routed_experts.quant_method
    assert type(method).__name__ == "NVFP4GroupedMoEMethod"
    list(layer.load_weights(iter(sorted(tensors.items()))))
    method.process_weights_after_loading(layer.routed_experts)
    if _release() == (0, 26):
        layer.maybe_init_modular_kernel()
    x = torch.randn(T, H, generator=gen).bfloat16()
    logits = torch.randn(T, E, generator=gen)
    with set_forward_context({}, vllm_config):
        out = layer(x, logits)
    tw, ids = route(x, logits, top_k, False)
    w13 = torch.cat([deq["gate_proj"], deq["up_proj"]], 1) if llama4 else deq["up_proj"]
    ref = _moe_reference(x, w13, deq["down_proj"], tw, ids, "silu" if llama4 else "relu2", on_input=llama4)
    assert out.shape == (T, H) and _rel(out, ref) <= FAMILY_REL_TOL


def test_repack_packs_into_the_checkpoint_parameters_memory(plugin, gen, monkeypatch):
    """H = I = 128 (no padding in the sm_90 layout): process_weights_after_loading packs w13 and w2 where the
    loaded parameters' bytes were (reuse_input_memory), so loading a layer needs no second copy of it; the packed
    weights still unpack to the checkpoint's exactly."""
    monkeypatch.setitem(globals(), "H", 128)
    ex = _experts(gen, inter=128)
    layer = _routed_experts(_config(plugin, "modelopt"), inter=128)
    list(layer.load_weights(iter(sorted(ex.tensors.items()))))
    where = {n: p.data_ptr() for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    weights = layer.moe_nvfp4_weights
    assert weights.w13_packed.data_ptr() == where["w13_weight"] and weights.w2_packed.data_ptr() == where["w2_weight"]
    assert weights.w13_scale.data_ptr() == where["w13_weight_scale"]
    assert weights.w2_scale.data_ptr() == where["w2_weight_scale"]
    w13, w2 = weights.to_nvfp4()
    assert torch.equal(w13.packed, ex.w13.packed) and torch.equal(w2.packed, ex.w2.packed)
    assert torch.equal(w2.block_scale.view(torch.uint8), ex.w2.block_scale.view(torch.uint8))


# ---------------------------------------------------------------- malformed quantization configs (issue 54)


@pytest.mark.parametrize("why, cfg, field", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_malformed_config_is_refused_naming_the_field(plugin, why, cfg, field):
    """Each of these crashed with a raw TypeError / AttributeError / re.error before issue 54."""
    import copy

    with pytest.raises(plugin.QuantConfigError) as info:
        plugin.NVFP4GroupedConfig.from_config(copy.deepcopy(cfg))
    assert info.value.field == field, str(info.value)


def test_from_config_fuzz(plugin):
    """Hostile configs (test_fuzz_plugin_config.configs) through vLLM's own parsers: each parses or raises
    QuantConfigError naming a field of the config.  Hypothesis inside one test: the plugin fixture is built once."""
    import copy

    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=EXAMPLES_VLLM, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(configs())
    def parse(cfg):
        try:
            qc = plugin.NVFP4GroupedConfig.from_config(copy.deepcopy(cfg))
        except plugin.QuantConfigError as e:
            assert_names_a_field(cfg, e)
            return
        assert isinstance(qc, plugin.NVFP4GroupedConfig)

    parse()


def test_fp8_activations_switch(plugin, gen, monkeypatch):
    """The W4A8 mode (design 008) is opt-in: the quantization config's ``fp8_activations`` or
    MOE_NVFP4_FP8_ACTIVATIONS (which wins; a value other than 0 or 1 is refused by name).  Switched on, the layer
    keeps the e4m3 copy and apply() runs what api.fused_moe runs with it: W4A8 where each expert expects enough
    rows, the W4A16 forward bit for bit below that."""
    import moe_nvfp4
    from moe_nvfp4.sm90 import w4a8 as w4a8_mode

    env = plugin.FP8_ACTIVATIONS_ENV
    monkeypatch.delenv(env, raising=False)
    assert not _config(plugin, "modelopt").fp8_activations
    assert plugin.NVFP4GroupedConfig.from_config({**MODELOPT_W4A16, "fp8_activations": True}).fp8_activations
    with pytest.raises(plugin.QuantConfigError, match="quantization_config.fp8_activations: expected true or false"):
        plugin.NVFP4GroupedConfig.from_config({**MODELOPT_W4A16, "fp8_activations": "yes"})
    monkeypatch.setenv(env, "0")
    assert not plugin.NVFP4GroupedConfig.from_config({**MODELOPT_W4A16, "fp8_activations": True}).fp8_activations
    monkeypatch.setenv(env, "on")
    with pytest.raises(ValueError, match=f"{env}='on': expected 1"):
        plugin.NVFP4GroupedConfig()
    monkeypatch.setenv(env, "1")
    ex = _experts(gen, "modelopt")
    layer = _routed_experts(_config(plugin, "modelopt"))
    _load(layer, ex.tensors)
    method = layer.quant_method
    assert method.fp8_weights is not None and method.fp8_weights.source is layer.moe_nvfp4_weights
    monkeypatch.setattr(w4a8_mode, "FP8_MIN_EAGER_FLOPS", 0.0)  # eager: the rows bound alone for this small layer
    t = 80 * E // TOPK  # sm90.w4a8.FP8_MIN_ROWS_PER_EXPERT rows an expert
    x, tw, ids = _routing(gen, t)
    weights = layer.moe_nvfp4_weights
    w4a8 = moe_nvfp4.fused_moe(x, weights, tw, ids, fp8_weights=method.fp8_weights)
    assert torch.equal(method.apply(layer, x, tw, ids, None, None), w4a8)
    assert not torch.equal(w4a8, moe_nvfp4.fused_moe(x, weights, tw, ids))
    few = slice(0, T)
    assert torch.equal(
        method.apply(layer, x[few], tw[few], ids[few], None, None),
        moe_nvfp4.fused_moe(x[few], weights, tw[few], ids[few]),
    )
