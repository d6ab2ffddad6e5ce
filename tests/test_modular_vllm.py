"""Our experts inside vLLM's modular kernel (integrations/moe_nvfp4_vllm/modular.py), on the CPU: vLLM's own
prepare/finalize objects around them (the batched one DeepEP low-latency's format comes from, the no-all2all standard
one), the weights each format leaves to the finalize, and which experts ``make_moe_kernel`` builds for which
all2all.  On the CPU our experts run the torch twins; the GPU kernels' tests are tests/gpu/test_modular_gpu.py.

| what                                                     | bound (||out - ref|| / ||ref||, float32 reference) |
|----------------------------------------------------------|----------------------------------------------------|
| batched: BatchedPrepareAndFinalize + our experts          | 1e-2 (its finalize weights and sums in bf16)       |
| standard: no-DP/EP prepare/finalize + our experts         | 1e-2 (bf16 output; exact math otherwise)           |
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import moe_nvfp4 as m

pytestmark = pytest.mark.vllm

BATCHED_TOL = 1e-2
STANDARD_TOL = 1e-2


@pytest.fixture(scope="module")
def vllm_cpu():
    """vLLM's modular-kernel pieces, with its workspace manager started on the CPU (its empty_cache needs an
    accelerator, so it is a no-op here: a CPU has no cache to empty)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    patch = pytest.MonkeyPatch()
    patch.setattr(torch.accelerator, "empty_cache", lambda: None)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    yield mk
    patch.undo()


def _moe_config(e_global: int, e_local: int, k: int, h: int, i: int, parallel=None):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        get_routing_method_type,
    )

    return FusedMoEConfig(
        num_experts=e_global,
        experts_per_token=k,
        hidden_dim=h,
        intermediate_size=i,
        num_local_experts=e_local,
        num_logical_experts=e_global,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=get_routing_method_type("softmax", k, True, None, False),
        moe_parallel_config=parallel or FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
    )


def _layer(gen: torch.Generator, e_local: int, h: int, i: int):
    q13 = m.quantize_nvfp4(torch.randn(e_local, 2 * i, h, generator=gen) / h**0.5, segments=2)
    q2 = m.quantize_nvfp4(torch.randn(e_local, h, i, generator=gen) / i**0.5)
    return q13, q2, m.prepare_moe_weights(q13, q2)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _run(kernel, x, weights, topk_weights, topk_ids, e_global, expert_map=None, on_input=False):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from moe_nvfp4_vllm.modular import apply_moe_kernel

    layer = SimpleNamespace(
        activation=MoEActivation.SILU,
        global_num_experts=e_global,
        expert_map=expert_map,
        apply_router_weight_on_input=on_input,
    )
    return apply_moe_kernel(kernel, layer, x, topk_weights, topk_ids)


@pytest.mark.parametrize(
    "e_global,rank,k,t,on_input",
    [
        pytest.param(6, 0, 2, 9, False, id="one rank, top-2, ragged experts"),
        pytest.param(8, 1, 3, 7, False, id="rank 1 of 2 (EP): other ranks' pairs contribute nothing here"),
        pytest.param(4, 0, 1, 5, True, id="router weight on the input (top-1): prepare applies it"),
    ],
)
def test_batched_format_through_vllms_batched_prepare_finalize(vllm_cpu, gen, e_global, rank, k, t, on_input) -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize

    from moe_nvfp4_vllm.modular import NVFP4GroupedBatchedExperts

    mk = vllm_cpu
    h, i, e_local = 64, 32, e_global // (2 if rank else 1)
    q13, q2, weights = _layer(gen, e_local, h, i)
    moe = _moe_config(e_global, e_local, k, h, i)
    quant = FusedMoEQuantConfig.make()
    experts = NVFP4GroupedBatchedExperts(moe, quant, weights, max_num_tokens=t, num_dispatchers=1)
    kernel = mk.FusedMoEKernel(BatchedPrepareAndFinalize(t, e_local, 1, rank), experts)
    x = torch.randn(t, h, generator=gen).bfloat16()
    topk_weights, topk_ids = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=True)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[rank * e_local : (rank + 1) * e_local] = torch.arange(e_local, dtype=torch.int32)
    out = _run(kernel, x.clone(), weights, topk_weights, topk_ids.long(), e_global, expert_map, on_input)
    ref = m.fused_moe_torch(
        x, q13, q2, topk_weights, topk_ids, expert_map=expert_map, apply_router_weight_on_input=on_input
    )
    assert out.shape == x.shape and _rel(out, ref) < BATCHED_TOL


@pytest.mark.parametrize("on_input", [False, True], ids=["weighted by our combine", "router weight on the input"])
def test_standard_format_through_the_no_all2all_prepare_finalize(vllm_cpu, gen, on_input: bool) -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moe_nvfp4_vllm.modular import NVFP4GroupedExperts

    mk = vllm_cpu
    e_global, e_local, h, i, t = 8, 4, 64, 32, 11
    k = 1 if on_input else 3
    q13, q2, weights = _layer(gen, e_local, h, i)
    experts = NVFP4GroupedExperts(_moe_config(e_global, e_local, k, h, i), FusedMoEQuantConfig.make(), weights)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    x = torch.randn(t, h, generator=gen).bfloat16()
    topk_weights, topk_ids = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=not on_input)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)  # a round-robin-like placement
    out = _run(kernel, x.clone(), weights, topk_weights, topk_ids.long(), e_global, expert_map, on_input)
    ref = m.fused_moe_torch(
        x, q13, q2, topk_weights, topk_ids, expert_map=expert_map, apply_router_weight_on_input=on_input
    )
    assert _rel(out, ref) < STANDARD_TOL


def test_standard_format_hands_the_ids_to_the_api_uncast(vllm_cpu, gen) -> None:
    """The experts pass vLLM's int64 ids on as they come, so the API's one cast applies: an id past int32 (2**40 + 1)
    saturates out of range and its pair contributes nothing, where a plain int32 cast would wrap it onto global
    expert 1, which this rank holds."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moe_nvfp4_vllm.modular import NVFP4GroupedExperts

    e_global, e_local, h, i, t, k = 8, 4, 64, 32, 5, 2
    q13, q2, weights = _layer(gen, e_local, h, i)
    experts = NVFP4GroupedExperts(_moe_config(e_global, e_local, k, h, i), FusedMoEQuantConfig.make(), weights)
    kernel = vllm_cpu.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    x = torch.randn(t, h, generator=gen).bfloat16()
    topk_weights, topk_ids = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=True)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    ids = topk_ids.long()
    ids[0, 0] = 2**40 + 1
    out = _run(kernel, x.clone(), weights, topk_weights, ids, e_global, expert_map)
    dropped = topk_ids.clone()
    dropped[0, 0] = -1  # routed nowhere (routing.routed_pairs)
    ref = m.fused_moe_torch(x, q13, q2, topk_weights, dropped, expert_map=expert_map)
    assert _rel(out, ref) < STANDARD_TOL


def test_each_format_leaves_the_finalize_what_it_expects(gen) -> None:
    """DeepEP low-latency's combine asserts a delegate (it weights and sums); the standard finalizes get the sum."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    from moe_nvfp4_vllm.modular import NVFP4GroupedBatchedExperts, NVFP4GroupedExperts

    _, _, weights = _layer(gen, 2, 64, 32)
    moe, quant = _moe_config(4, 2, 2, 64, 32), FusedMoEQuantConfig.make()
    batched = NVFP4GroupedBatchedExperts(moe, quant, weights, max_num_tokens=16, num_dispatchers=2)
    standard = NVFP4GroupedExperts(moe, quant, weights)
    assert batched.activation_format() is FusedMoEActivationFormat.BatchedExperts
    assert standard.activation_format() is FusedMoEActivationFormat.Standard
    assert isinstance(batched.finalize_weight_and_reduce_impl(), TopKWeightAndReduceDelegate)
    assert isinstance(standard.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOP)
    assert batched.workspace_shapes(16, 0, 64, 2, 4, 2, None, moe.activation)[2] == (2, 16, 64)
    assert standard.workspace_shapes(9, 0, 64, 2, 4, 2, None, moe.activation)[2] == (9, 64)
    # 8 tokens a rank from 2 dispatchers, top-2 of 4 experts: 32 pairs over 4 busy experts
    assert batched.expected_rows(8, 2, 4) == pytest.approx(8.0, rel=1e-3)
    with pytest.raises(ValueError, match="expert_tokens_meta"):
        batched.apply(
            None, None, None, None, None, torch.zeros(1, 2), None, 4, None, None, None, None, None, None, False
        )
    with pytest.raises(ValueError, match="max_num_tokens and num_dispatchers must be set"):
        NVFP4GroupedBatchedExperts(moe, quant, weights)


def test_make_moe_kernel_picks_the_experts_of_the_all2all(monkeypatch, gen) -> None:
    """No all2all (no EP): no kernel, the method calls fused_moe itself.  With one, the prepare/finalize vLLM makes
    for the backend (allow_new_interface, 16-bit activations) decides the format of the experts."""
    import vllm.model_executor.layers.fused_moe.all2all_utils as all2all_utils
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moe_nvfp4_vllm.modular import NVFP4GroupedBatchedExperts, NVFP4GroupedExperts, make_moe_kernel

    _, _, weights = _layer(gen, 2, 64, 32)
    assert make_moe_kernel(_moe_config(4, 2, 2, 64, 32), weights) is None
    parallel = dataclasses.replace(
        _moe_config(4, 2, 2, 64, 32).moe_parallel_config,
        dp_size=2,
        ep_size=2,
        use_ep=True,
        all2all_backend="deepep_low_latency",
    )
    moe = _moe_config(4, 2, 2, 64, 32, parallel)
    asked = []

    def fake_prepare_finalize(made):
        def make(**kwargs):
            asked.append(kwargs)
            return made

        return make

    monkeypatch.setattr(
        all2all_utils, "maybe_make_prepare_finalize", fake_prepare_finalize(BatchedPrepareAndFinalize(48, 2, 2, 1))
    )
    kernel = make_moe_kernel(moe, weights, routing_tables=None)
    assert isinstance(kernel.fused_experts, NVFP4GroupedBatchedExperts) and kernel.fused_experts.weights is weights
    assert (kernel.fused_experts.max_num_tokens, kernel.fused_experts.num_dispatchers) == (48, 2)
    assert asked[-1]["allow_new_interface"] and asked[-1]["quant_config"].quant_dtype is None
    monkeypatch.setattr(
        all2all_utils, "maybe_make_prepare_finalize", fake_prepare_finalize(MoEPrepareAndFinalizeNoDPEPModular())
    )
    assert isinstance(make_moe_kernel(moe, weights).fused_experts, NVFP4GroupedExperts)
    monkeypatch.setattr(all2all_utils, "maybe_make_prepare_finalize", fake_prepare_finalize(None))
    with pytest.raises(RuntimeError, match="no prepare/finalize for all2all backend deepep_low_latency"):
        make_moe_kernel(moe, weights)
