"""GPU tier of the batched format and of our experts in vLLM's modular kernel (run with ``pytest -m gpu``).

| what                                                           | bound (||out - ref|| / ||ref||)                  |
|----------------------------------------------------------------|--------------------------------------------------|
| fused_moe_batched vs the float64 twin, per expert's rows         | bf16 1e-2, fp16 2e-3 (x, act, output roundings)   |
| the same captured in a CUDA graph, replayed on new x and counts  | the same                                          |
| vLLM BatchedPrepareAndFinalize + our batched experts (eager; the | 2e-2 (its finalize weights and sums in bf16)      |
| experts stage captured in a CUDA graph) vs fused_moe_torch       |                                                  |
| vLLM's no-all2all standard prepare/finalize + our experts        | 1e-2                                             |
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.expert_activation import RELU2, SWIGLU_OAI

pytestmark = pytest.mark.gpu

REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
VLLM_BATCHED_TOL = 2e-2
VLLM_STANDARD_TOL = 1e-2


def _layer(gen, e, h, i, activation=m.SILU, bias=False):
    rows = 2 * i if activation.gated else i
    q13 = m.quantize_nvfp4(torch.randn(e, rows, h, generator=gen) / h**0.5, segments=2 if activation.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) / i**0.5)
    b13 = torch.randn(e, rows, generator=gen) if bias else None
    b2 = torch.randn(e, h, generator=gen) if bias else None
    cuda = lambda q: m.NVFP4Tensor(q.packed.cuda(), q.block_scale.cuda(), q.global_scale.cuda())  # noqa: E731
    w = m.prepare_moe_weights(
        cuda(q13),
        cuda(q2),
        activation=activation,
        w13_bias=None if b13 is None else b13.cuda(),
        w2_bias=None if b2 is None else b2.cuda(),
    )
    return q13, q2, b13, b2, w


def _worst_expert_error(out, x, q13, q2, counts, activation=m.SILU, b13=None, b2=None) -> float:
    """The largest per-expert relative error of the counted rows against the float64 twin; asserts rows past each
    count were left as they were (NaN)."""
    ref = m.fused_moe_batched_torch(
        torch.nan_to_num(x.cpu()),
        q13,
        q2,
        counts.cpu(),
        activation=activation,
        w13_bias=b13,
        w2_bias=b2,
        compute_dtype=torch.float64,
    )
    worst = 0.0
    for expert, count in enumerate(counts.cpu().clamp(0, x.shape[1]).tolist()):
        assert out[expert, count:].isnan().all(), f"expert {expert}: a row past its count was written"
        if count:
            got, want = out[expert, :count].cpu().double(), ref[expert, :count]
            worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


def _batched_inputs(gen, e, max_tokens, h, dtype, counts):
    x = torch.randn(e, max_tokens, h, generator=gen).to(dtype)
    for expert, count in enumerate(counts.clamp(0, max_tokens).tolist()):
        x[expert, count:] = float("nan")  # padding rows: garbage that must reach no counted row
    return x.cuda(), counts.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "e,h,i,max_tokens,counts,expected_rows",
    [
        pytest.param(8, 2048, 768, 128, [1, 0, 3, 0, 2, 1, 0, 128], 1.0, id="decode: 8-row tiles, one expert full"),
        pytest.param(16, 2048, 768, 100, [7] * 8 + [0] * 7 + [100], 8.0, id="16-row tiles, M=100"),
        pytest.param(4, 4096, 1536, 300, [300, 17, 0, 299], 40.0, id="64-row tiles, M=300 not a tile multiple"),
        pytest.param(2, 1024, 512, 513, [513, 200], 400.0, id="128-row tiles (Triton prefill GEMMs)"),
        pytest.param(3, 1024, 512, 64, [-5, 90, 64], 4.0, id="corrupt counts clamped to [0, M]"),
    ],
)
def test_batched_matches_twin(gen, dtype, e, h, i, max_tokens, counts, expected_rows) -> None:
    q13, q2, _, _, w = _layer(gen, e, h, i)
    x, counts = _batched_inputs(gen, e, max_tokens, h, dtype, torch.tensor(counts, dtype=torch.int32))
    out = torch.full_like(x, float("nan"))
    m.fused_moe_batched(x, w, counts, expected_rows=expected_rows, out=out)
    assert _worst_expert_error(out, x, q13, q2, counts) < REL_TOL[dtype]


@pytest.mark.parametrize("activation,bias", [(SWIGLU_OAI, True), (RELU2, False)], ids=["swiglu_oai+bias", "relu2"])
def test_batched_expert_variants(gen, activation, bias) -> None:
    q13, q2, b13, b2, w = _layer(gen, 8, 1024, 512, activation, bias)
    x, counts = _batched_inputs(gen, 8, 32, 1024, torch.bfloat16, torch.tensor([1, 32, 0, 5, 2, 0, 9, 1]))
    out = torch.full_like(x, float("nan"))
    m.fused_moe_batched(x, w, counts, expected_rows=2.0, out=out)
    assert _worst_expert_error(out, x, q13, q2, counts, activation, b13, b2) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("expected_rows", [1.0, 8.0, 40.0], ids=["8-row tiles", "16-row tiles", "64-row tiles"])
def test_batched_in_a_cuda_graph_replays_new_counts(gen, expected_rows) -> None:
    """One capture, replays with new x and new counts written into the captured buffers (what DeepEP low-latency's
    graph-captured dispatch does): the plan is rebuilt on the device every replay."""
    e, h, i, max_tokens = 16, 2048, 768, 64
    q13, q2, _, _, w = _layer(gen, e, h, i)
    x = torch.zeros(e, max_tokens, h, dtype=torch.bfloat16, device="cuda")
    counts = torch.zeros(e, dtype=torch.int32, device="cuda")
    out = torch.full_like(x, float("nan"))
    m.fused_moe_batched(x, w, counts, expected_rows=expected_rows, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.fused_moe_batched(x, w, counts, expected_rows=expected_rows, out=out)
    for _ in range(3):
        new_counts = torch.randint(0, max_tokens + 1, (e,), generator=gen, dtype=torch.int32)
        new_counts[torch.randint(0, e, (3,), generator=gen)] = 0
        new_x, new_counts = _batched_inputs(gen, e, max_tokens, h, torch.bfloat16, new_counts)
        x.copy_(new_x)
        counts.copy_(new_counts)
        out.fill_(float("nan"))
        graph.replay()
        assert _worst_expert_error(out, x, q13, q2, counts) < REL_TOL[torch.bfloat16]


# ---- through vLLM's modular kernel -------------------------------------------------------------------------------
def _vllm_on_gpu():
    pytest.importorskip("vllm")
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cuda"))


def _moe_config(e_global, e_local, k, h, i):
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
        device="cuda",
        routing_method=get_routing_method_type("softmax", k, True, None, False),
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
    )


def _rel(out, ref) -> float:
    return float((out.float().cpu() - ref.float()).norm() / ref.float().norm())


@pytest.mark.vllm
@pytest.mark.parametrize("rank", [0, 1], ids=["one rank", "rank 1 of 2 (EP)"])
def test_vllm_batched_prepare_finalize_eager_and_experts_in_a_graph(gen, rank) -> None:
    """vLLM's BatchedPrepareAndFinalize (the batched layout DeepEP low-latency also hands over) + our batched experts
    in FusedMoEKernel, eagerly; then the experts stage captured in a CUDA graph on the prepared batch and replayed
    on a new one (the reference prepare/finalize reads counts on the host, so it stays outside the graph)."""
    _vllm_on_gpu()
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize

    from moe_nvfp4_vllm.modular import NVFP4GroupedBatchedExperts, apply_moe_kernel

    e_global, k, h, i, t = 32, 4, 2048, 768, 24
    e_local = e_global // 2 if rank else e_global
    q13, q2, _, _, w = _layer(gen, e_local, h, i)
    quant = FusedMoEQuantConfig.make()
    experts = NVFP4GroupedBatchedExperts(
        _moe_config(e_global, e_local, k, h, i), quant, w, max_num_tokens=t, num_dispatchers=1
    )
    prepare_finalize = BatchedPrepareAndFinalize(t, e_local, 1, rank)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[rank * e_local : (rank + 1) * e_local] = torch.arange(e_local, dtype=torch.int32)
    layer = SimpleNamespace(
        activation=MoEActivation.SILU,
        global_num_experts=e_global,
        expert_map=expert_map.cuda(),
        apply_router_weight_on_input=False,
    )

    def routing():
        x = torch.randn(t, h, generator=gen).bfloat16()
        tw, ti = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=True)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=expert_map)
        return x.cuda(), tw.cuda(), ti.long().cuda(), ref

    x, tw, ti, ref = routing()
    assert _rel(apply_moe_kernel(kernel, layer, x, tw, ti), ref) < VLLM_BATCHED_TOL

    a1q, _, meta, _, _ = prepare_finalize.prepare(x, tw, ti, e_global, None, False, quant)
    out = torch.empty_like(a1q)
    step = dict(
        w1=w.w13_packed,
        w2=w.w2_packed,
        topk_weights=tw,
        topk_ids=ti,
        activation=MoEActivation.SILU,
        global_num_experts=e_global,
        expert_map=None,
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=meta,
        apply_router_weight_on_input=False,
    )
    experts.apply(out, a1q, **step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts.apply(out, a1q, **step)
    x, tw, ti, ref = routing()
    new_a1q, _, new_meta, _, _ = prepare_finalize.prepare(x, tw, ti, e_global, None, False, quant)
    a1q.copy_(new_a1q)
    meta.expert_num_tokens.copy_(new_meta.expert_num_tokens)
    graph.replay()
    final = torch.empty_like(x)
    prepare_finalize.finalize(final, out, tw, ti, False, experts.finalize_weight_and_reduce_impl())
    assert _rel(final, ref) < VLLM_BATCHED_TOL


@pytest.mark.vllm
def test_vllm_standard_format_eager_and_in_a_graph(gen) -> None:
    """vLLM's no-all2all standard prepare/finalize + our standard experts with an expert map (EP's local view),
    eagerly and captured whole in a CUDA graph."""
    _vllm_on_gpu()
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moe_nvfp4_vllm.modular import NVFP4GroupedExperts, apply_moe_kernel

    e_global, e_local, k, h, i, t = 64, 32, 8, 2048, 768, 40
    q13, q2, _, _, w = _layer(gen, e_local, h, i)
    experts = NVFP4GroupedExperts(_moe_config(e_global, e_local, k, h, i), FusedMoEQuantConfig.make(), w)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[e_local:] = torch.arange(e_local, dtype=torch.int32)
    layer = SimpleNamespace(
        activation=MoEActivation.SILU,
        global_num_experts=e_global,
        expert_map=expert_map.cuda(),
        apply_router_weight_on_input=False,
    )
    x = torch.randn(t, h, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=True)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=expert_map)
    x, tw, ti = x.cuda(), tw.cuda(), ti.long().cuda()
    assert _rel(apply_moe_kernel(kernel, layer, x, tw, ti), ref) < VLLM_STANDARD_TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_moe_kernel(kernel, layer, x, tw, ti)
    x2 = torch.randn(t, h, generator=gen).bfloat16()
    tw2, ti2 = m.topk_softmax(torch.randn(t, e_global, generator=gen), k, renormalize=True)
    x.copy_(x2.cuda()), tw.copy_(tw2.cuda()), ti.copy_(ti2.long().cuda())
    graph.replay()
    assert _rel(out, m.fused_moe_torch(x2, q13, q2, tw2, ti2, expert_map=expert_map)) < VLLM_STANDARD_TOL
