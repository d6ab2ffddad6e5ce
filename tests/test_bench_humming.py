"""CPU tests of bench_moe.py's Humming path: vLLM 0.26's own code (backend oracle, ModelOpt -> Humming conversion,
modular kernel, forward context, workspaces) runs on CPU; only the humming-kernels package is faked, at the names
vLLM imports it through (``vllm.utils.humming``: weight schemas and HummingMethod), and so are the experts' GPU
kernels (HummingIndexedExperts.apply).  Whether the kernels compute the right thing is the GPU bench's rel-err check.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.vllm

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
T = 3  # tokens of the forward test


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(BENCH, "bench_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass(frozen=True)
class DType:
    name: str
    num_bits: int

    def __str__(self) -> str:
        return self.name


DTYPES = types.SimpleNamespace(
    **{
        n: DType(n, b)
        for n, b in [
            ("float16", 16),
            ("bfloat16", 16),
            ("float32", 32),
            ("float8e4m3", 8),
            ("float8e5m2", 8),
            ("int8", 8),
            ("int4", 4),
            ("float4e2m1", 4),
        ]
    }
)


class GemmType(enum.Enum):
    INDEXED = "indexed"
    GROUPED_CONTIGUOUS = "grouped_contiguous"
    GROUPED_MASKED = "grouped_masked"


@dataclasses.dataclass
class HummingWeightSchema:
    """What humming's ModeloptNvfp4WeightSchema.convert_humming gives for one global scale per expert."""

    b_dtype: DType = DTYPES.float4e2m1
    weight_scale_group_size: int = 16
    weight_scale_group_size_n: int = 0


class HummingInputSchema:
    a_dtype = None  # bf16 activations

    def convert_humming(self, tensors, **kw):
        return self, {}


class FakeHumming:
    """The humming-kernels entry points vLLM calls, recording what it hands them."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.applied: list[dict] = []
        fake = self

        class ModeloptSchema:
            def __init__(self, config):
                fake.calls.append(("from_config", config))

            def convert_humming(self, tensors, shape_n_stacks, shape_k_stacks, param_dtype, num_experts):
                fake.calls.append(("convert", dict(tensors), shape_n_stacks, shape_k_stacks, param_dtype, num_experts))
                gs = tensors["weight_scale_2"].reshape(num_experts, -1)[:, 0]
                return HummingWeightSchema(), {
                    "weight": tensors["weight"].view(torch.int32),
                    "weight_scale": tensors["weight_scale"],
                    "global_scale": gs,
                }

        class HummingMethod:
            @staticmethod
            def prepare_layer_meta(layer, **kw):
                fake.calls.append(("meta", kw))
                pad = lambda v, m: -(-v // m) * m  # noqa: E731
                layer.humming_metas = getattr(layer, "humming_metas", {})
                layer.humming_metas[kw["sublayer_name"]] = types.SimpleNamespace(
                    num_experts=kw["num_experts"],
                    shape_n=pad(kw["shape_n"], kw["pad_n_to_multiple"]),
                    shape_k=pad(kw["shape_k"], kw["pad_k_to_multiple"]),
                    a_dtype=DTYPES.bfloat16,
                    c_dtype=DTYPES.bfloat16,
                )

            @staticmethod
            def transform_humming_layer(layer, sublayer_name):
                fake.calls.append(("transform", sublayer_name, sorted(n for n, _ in layer.named_parameters())))

            @staticmethod
            def get_default_tuning_configs(layer, sublayer_name, **kw):
                return [[0, 1 << 30, {"block_shape": [16, 128, 128]}]]

        self.facade = dict(
            BaseWeightSchema=types.SimpleNamespace(from_config=ModeloptSchema),
            HummingWeightSchema=HummingWeightSchema,
            HummingInputSchema=HummingInputSchema,
            HummingMethod=HummingMethod,
            HummingLayerMeta=object,
            GemmType=GemmType,
            dtypes=DTYPES,
        )

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def bench():
    return _load_bench()


def fake_apply(seen: list):
    """HummingIndexedExperts.apply less its GPU kernels: records what vLLM's modular kernel passes and the buffers
    the experts carve from the workspaces, then writes a marker into the output."""

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        buffers = self.prepare_buffers(workspace13, workspace2, topk_ids.size(0), topk_ids.size(1), activation)
        seen.append(
            dict(
                x=hidden_states,
                w=topk_weights,
                ids=topk_ids,
                act=activation,
                e=global_num_experts,
                map=expert_map,
                m=self.estimate_local_valid_shape_m(topk_ids),
                w1=w1,
                layer=self.layer,
                shapes={k: tuple(v.shape) for k, v in buffers.items()},
            )
        )
        output.fill_(1.5)

    return apply


@pytest.fixture
def vllm_humming(monkeypatch):
    """vLLM's Humming modules, imported as they are, then humming-kernels faked behind them: ``import humming``
    finds a stub, ``vllm.utils.humming`` hands out FakeHumming's names, the experts accept a CPU and run
    fake_apply; the workspace manager (a global) starts empty and is dropped afterwards."""
    from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe
    from vllm.model_executor.layers.quantization.utils import humming_utils  # noqa: F401
    from vllm.utils import humming as facade
    from vllm.v1.worker import workspace

    fake = FakeHumming()
    monkeypatch.setitem(sys.modules, "humming", types.ModuleType("humming"))
    for name, value in fake.facade.items():
        monkeypatch.setitem(vars(facade), name, value)  # not setattr: its getattr would import humming
    monkeypatch.setattr(fused_humming_moe.HummingExpertsBase, "_supports_current_device", staticmethod(lambda: True))
    monkeypatch.setattr(fused_humming_moe.HummingIndexedExperts, "apply", fake_apply(fake.applied))
    monkeypatch.setattr(workspace, "_manager", None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # the manager's, on growth; no CPU one
    return fake, fused_humming_moe


def test_prepare_hands_vllm_the_modelopt_checkpoint(bench, vllm_humming):
    fake, fused = vllm_humming
    shape = bench.TINY
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    weights = bench.make_weights(shape, seed=0, device="cpu")
    w13_q, w2_q = weights[:2]
    p = bench.build_path("humming", shape, weights, copies=3)

    assert fake.of("from_config") == [("from_config", {"quant_method": "modelopt", "quant_algo": "nvfp4"})]
    (_, t13, n13, k13, dt13, e13), (_, t2, n2, k2, dt2, e2) = fake.of("convert")
    assert (n13, k13, dt13, e13) == ([i, i], [h], torch.bfloat16, e)  # gate and up stacked along N
    assert (n2, k2, dt2, e2) == ([h], [i], torch.bfloat16, e)
    for t, q in ((t13, w13_q), (t2, w2_q)):
        assert t["weight"].dtype == torch.uint8 and torch.equal(t["weight"], q.packed)
        assert torch.equal(t["weight_scale"].view(torch.uint8), q.block_scale.view(torch.uint8))
        assert t["weight"].data_ptr() != q.packed.data_ptr()  # vLLM's conversion gets the layer's own copy
    assert torch.equal(t13["weight_scale_2"], w13_q.global_scale[:, None].expand(e, 2))  # ModelOpt's [E, 2]
    assert torch.equal(t2["weight_scale_2"], w2_q.global_scale)
    assert set(t13) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}

    metas = {kw["sublayer_name"]: kw for _, kw in fake.of("meta")}
    for sub, (n, k) in {"w13": (2 * i, h), "w2": (h, i)}.items():
        kw = metas[sub]
        assert (kw["shape_n"], kw["shape_k"], kw["num_experts"], kw["torch_dtype"], kw["has_bias"]) == (
            n,
            k,
            e,
            torch.bfloat16,
            False,
        )
        assert (kw["pad_n_to_multiple"], kw["pad_k_to_multiple"]) == (256, 128)
    # transform sees the converted parameters only: the checkpoint's scale_2 and activation scales are gone
    assert fake.of("transform") == [
        (
            "transform",
            "w13",
            [
                "w13_global_scale",
                "w13_weight",
                "w13_weight_scale",
                "w2_input_scale",
                "w2_weight",
                "w2_weight_scale",
                "w2_weight_scale_2",
            ],
        ),
        (
            "transform",
            "w2",
            ["w13_global_scale", "w13_weight", "w13_weight_scale", "w2_global_scale", "w2_weight", "w2_weight_scale"],
        ),
    ]

    assert len(p.weights) == len(p._kernels) == 3
    # the oracle's pick among the three Humming experts classes (all accept this device here)
    assert all(type(k.fused_experts) is fused.HummingIndexedExperts for k in p._kernels)
    assert [k.fused_experts.layer for k in p._kernels] == p.weights
    a, b = p.weights[0], p.weights[1]
    assert torch.equal(a.w13_weight, b.w13_weight) and a.w13_weight.data_ptr() != b.w13_weight.data_ptr()
    assert a.locks.data_ptr() != b.locks.data_ptr() and a.humming_metas is b.humming_metas


def test_forward_runs_vllms_modular_kernel(bench, vllm_humming):
    fake, _ = vllm_humming
    shape = bench.TINY
    e, h, i, k = shape.experts, shape.hidden, shape.intermediate, shape.top_k
    p = bench.build_path("humming", shape, bench.make_weights(shape, seed=0, device="cpu"), copies=2)
    assert len(fake.applied) == 1 and fake.applied[0]["x"].shape == (1, h)  # the warm-up (on a GPU: the JIT)
    x, topk_weights, topk_ids, expert_map = bench.make_inputs(shape, T, seed=0, device="cpu")
    assert expert_map is None  # no expert parallelism: the Humming path has no expert map
    out = p.fn(1, x, topk_weights, topk_ids)()
    assert out.shape == (T, h) and out.dtype == torch.bfloat16 and bool((out == 1.5).all())
    s = fake.applied[-1]
    assert s["x"] is x and s["w"] is topk_weights and s["ids"] is topk_ids
    assert s["layer"] is p.weights[1] and s["w1"] is p.weights[1].w13_weight
    assert (s["e"], s["map"], s["m"]) == (e, None, T * k)  # the forward context: no DP metadata
    assert s["act"].name == "SILU"
    assert s["shapes"] == {
        "gate_up_output": (T * k, 2 * i),
        "activation_output": (T * k, i),
        "down_output": (T * k, h),
        "output": (T, h),
    }


def test_refusals_say_why(bench, vllm_humming, monkeypatch):
    fake, fused = vllm_humming
    shape = bench.TINY
    weights = bench.make_weights(shape, seed=0, device="cpu")
    monkeypatch.setattr(fused.HummingExpertsBase, "_supports_current_device", staticmethod(lambda: False))
    with pytest.raises(RuntimeError, match="oracle refuses HUMMING: kernel does not support current device"):
        bench.build_path("humming", shape, weights, copies=1)
    monkeypatch.setitem(sys.modules, "humming", None)  # installed but broken: import fails
    with pytest.raises(RuntimeError, match="humming-kernels does not import"):
        bench.build_path("humming", shape, weights, copies=1)
    ep = dataclasses.replace(shape, global_experts=2 * shape.experts)  # one rank of EP=2
    with pytest.raises(RuntimeError, match="no expert map"):
        bench.build_path("humming", ep, weights, copies=1)
    assert fake.calls == [] and fake.applied == []
