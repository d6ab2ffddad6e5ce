"""Our experts as vLLM's modular experts stage, so vLLM's DP + EP all2all backends drive them.

vLLM splits a MoE forward into prepare (dispatch: tokens to the ranks holding their experts) -> experts -> finalize
(combine: weighted sum back on the token's rank), ``modular_kernel.FusedMoEKernel(prepare_finalize, experts)``.  A
prepare/finalize hands the experts one of two activation formats:

* Standard (allgather/reduce-scatter, DeepEP high-throughput, DeepEP v2, MoRI, FlashInfer NVLink): x [M, H] with
  each token's topk_ids (global ids) and weights; ``NVFP4GroupedExperts`` runs ``moe_nvfp4.fused_moe`` with the
  layer's expert map, weighted and summed (``TopKWeightAndReduceNoOP``: the finalize only combines).
* Batched (DeepEP low-latency, NIXL EP; ``BatchedPrepareAndFinalize``): x [local E, max tokens, H] with per-expert
  counts; ``NVFP4GroupedBatchedExperts`` runs ``moe_nvfp4.fused_moe_batched`` on that layout as it lies (no
  repack), unweighted (``TopKWeightAndReduceDelegate``: DeepEP's combine or the batched finalize weights and sums,
  and asserts it was asked to).

Either way the router weight on the input (top-1, Llama-4) was applied by prepare, so the experts add no weight.
``make_moe_kernel`` builds the kernel where vLLM runs an all2all (``use_all2all_kernels``: DP > 1 with EP, and
allgather/reduce-scatter too); the method holds it as ``moe_kernel`` (vLLM 0.26 and 0.33 alike: a method holding a
kernel gets no naive dispatch/combine from the MoE runner) and ``apply_moe_kernel`` calls it.  Without an all2all
(TP, DP without EP) there is no kernel and the method calls ``fused_moe`` itself, as before.

Activations cross the all2all in 16 bits (``FusedMoEQuantConfig.make()``: nothing for vLLM to quantize); the NVFP4
weights never leave the rank.  Design record: docs/design/009-modular-experts.md.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)
from vllm.platforms import current_platform

import moe_nvfp4
from moe_nvfp4.shapes import LayerShape

__all__ = ["NVFP4GroupedBatchedExperts", "NVFP4GroupedExperts", "apply_moe_kernel", "make_moe_kernel"]

logger = init_logger(f"vllm.{__name__}")  # under "vllm", whose handlers vLLM configures
SUPPORTED_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUOAI, MoEActivation.RELU2_NO_MUL)


class _Experts(mk.FusedMoEExpertsModular):
    """What both formats share: the packed ``MoEWeights`` (their activation and biases; the ``w1``/``w2`` the kernel
    passes are only read for their expert count) and what vLLM's oracle asks of an experts class."""

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        weights: moe_nvfp4.MoEWeights,
        max_num_tokens: int | None = None,
        num_dispatchers: int | None = None,
    ) -> None:
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self.weights = weights

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True  # relu2_no_mul (Nemotron-H)

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return activation_key is None  # NVFP4 weights packed by the method; 16-bit activations

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in SUPPORTED_ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True


class NVFP4GroupedExperts(_Experts):
    """The standard format: hidden_states [M, H], topk_ids [M, k] global ids (DeepEP high-throughput marks the
    slots of other ranks with ids the expert map sends to -1), the output weighted and summed [M, H]."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (M, K)  # fused_moe keeps its own intermediates

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

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
        # prepare scaled the input by the router weight already: the sum takes each pair once, unweighted
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        output.copy_(moe_nvfp4.fused_moe(hidden_states, self.weights, weights, topk_ids, expert_map=expert_map))


class NVFP4GroupedBatchedExperts(_Experts):
    """The batched format: hidden_states [local E, max_num_tokens, H] and ``expert_tokens_meta.expert_num_tokens``;
    output [local E, max_num_tokens, H], each expert's first count rows written, unweighted."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (local_num_experts, M, K)  # M: max tokens per expert (moe_problem_size)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()

    def expected_rows(self, tokens_per_rank: int, top_k: int, global_num_experts: int) -> float:
        """Rows a busy local expert holds when every dispatcher sends ``tokens_per_rank`` tokens, uniform routing
        (LayerShape.rows_per_active_expert over the global experts): what picks the kernel config."""
        w = self.weights
        shape = LayerShape(w.num_experts, top_k, w.hidden, w.intermediate, global_experts=global_num_experts)
        return shape.rows_per_active_expert(max(1, tokens_per_rank * self.num_dispatchers))

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
        if expert_tokens_meta is None or expert_tokens_meta.expert_num_tokens is None:
            raise ValueError("the batched format needs the per-expert token counts (expert_tokens_meta)")
        rows = self.expected_rows(topk_ids.shape[0], topk_ids.shape[1], global_num_experts)
        # DeepEP gives one count per local expert; BatchedPrepareAndFinalize one per global expert, this rank's first
        counts = expert_tokens_meta.expert_num_tokens[: self.weights.num_experts]
        moe_nvfp4.fused_moe_batched(hidden_states, self.weights, counts, expected_rows=rows, out=output)


def make_moe_kernel(
    moe: FusedMoEConfig,
    weights: moe_nvfp4.MoEWeights,
    routing_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> mk.FusedMoEKernel | None:
    """The modular kernel of vLLM's all2all backend for this layer around our experts, or None where vLLM runs no
    all2all (no EP, or one rank): the method then calls fused_moe itself.  Call it after the weights are packed
    (the prepare/finalize takes the all2all manager's buffers); ``routing_tables``: the layer's
    ``_expert_routing_tables()`` (DeepEP low-latency with round-robin placement)."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize

    if not moe.moe_parallel_config.use_all2all_kernels:
        return None
    quant_config = FusedMoEQuantConfig.make()  # activations dispatched in 16 bits, nothing quantized by vLLM
    prepare_finalize = maybe_make_prepare_finalize(
        moe=moe, quant_config=quant_config, routing_tables=routing_tables, allow_new_interface=True
    )
    if prepare_finalize is None:
        raise RuntimeError(
            f"vLLM made no prepare/finalize for all2all backend {moe.moe_parallel_config.all2all_backend}"
        )
    if prepare_finalize.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        experts: _Experts = NVFP4GroupedBatchedExperts(
            moe,
            quant_config,
            weights,
            max_num_tokens=prepare_finalize.max_num_tokens_per_rank(),
            num_dispatchers=prepare_finalize.num_dispatchers(),
        )
    else:
        experts = NVFP4GroupedExperts(moe, quant_config, weights)
    # benchmarks/dp_ep_check.py looks for this line: it shows vLLM's all2all drives our experts
    logger.info_once(
        "nvfp4_grouped: our experts in vLLM's modular kernel (%s + %s)",
        type(prepare_finalize).__name__,
        type(experts).__name__,
    )
    return mk.FusedMoEKernel(prepare_finalize, experts)


def apply_moe_kernel(
    kernel: mk.FusedMoEKernel,
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_experts=None,
    shared_experts_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """The method's ``apply`` where it holds a kernel: prepare (dispatch), our experts, finalize (combine), with the
    layer's routing settings.  The packed tensors stand in for vLLM's w1/w2 (the kernel reads their expert count)."""
    weights = kernel.fused_experts.weights
    return kernel.apply(
        x,
        weights.w13_packed,
        weights.w2_packed,
        topk_weights,
        topk_ids,
        activation=layer.activation,
        global_num_experts=layer.global_num_experts,
        expert_map=layer.expert_map,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        shared_experts=shared_experts,
        shared_experts_input=shared_experts_input,
    )
