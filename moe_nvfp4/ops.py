"""torch.library custom ops with fake implementations, so torch.compile and CUDA graphs see one opaque op."""
from __future__ import annotations

import functools

import torch

from .backends import TORCH
from .dispatch import select_backends
from .expert_activation import ExpertActivation

__all__ = ["fused_moe_op", "fused_moe_w4a4_op", "fused_moe_w4a4_flashinfer_op"]


@functools.cache
def _expert_activation(name: str, alpha: float, limit: float) -> ExpertActivation:
    """The op's activation fields as the data they spell, validated once per distinct value (not every forward)."""
    return ExpertActivation(name, alpha, limit)


@torch.library.custom_op("moe_nvfp4::fused_moe", mutates_args=())
def fused_moe_op(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    intermediate: int,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Tensors as in weights.MoEWeights, the activation as expert_activation.ExpertActivation's fields; inputs
    already checked by api.fused_moe.  The config is the host wrapper's choice (configs.select_config)."""
    act = _expert_activation(activation, alpha, limit)
    if select_backends(x.device).moe_w4a16 is TORCH:
        from .weights import MoEWeights
        from .reference import fused_moe_torch

        weights = MoEWeights(w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, x.shape[1],
                             intermediate, activation=act)  # fmt: skip
        w13, w2 = weights.to_nvfp4()
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=act,
                               w13_bias=w13_bias, w2_bias=w2_bias,
                               apply_router_weight_on_input=apply_router_weight_on_input)  # fmt: skip
    from .triton.moe_sm90 import fused_moe_sm90

    return fused_moe_sm90(
        x, w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, topk_weights, topk_ids,
        expert_map, intermediate, activation=act, w13_bias=w13_bias, w2_bias=w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )  # fmt: skip


@fused_moe_op.register_fake
def _(x, w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, topk_weights, topk_ids, expert_map,
      intermediate, w13_bias=None, w2_bias=None, activation="silu", alpha=1.702, limit=7.0,
      apply_router_weight_on_input=False):  # fmt: skip
    return torch.empty_like(x)


@torch.library.custom_op("moe_nvfp4::fused_moe_w4a4", mutates_args=())
def fused_moe_w4a4_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    intermediate: int,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """weights: ``MoEWeightsSm100.tensors()``; inputs already checked by api.fused_moe_w4a4."""
    from .cute.moe_host import MoEWeightsSm100, fused_moe_w4a4_sm100

    packed = MoEWeightsSm100.from_tensors(weights, intermediate)
    if select_backends(x.device).moe_w4a4 is TORCH:
        from .reference import fused_moe_torch

        w13, w2 = packed.to_nvfp4()
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                               w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale)  # fmt: skip
    return fused_moe_w4a4_sm100(x, packed, topk_weights, topk_ids, expert_map, (w13_input_scale, w2_input_scale))


@fused_moe_w4a4_op.register_fake
def _(x, weights, topk_weights, topk_ids, expert_map, intermediate, w13_input_scale, w2_input_scale):
    return torch.empty_like(x)


@torch.library.custom_op("moe_nvfp4::fused_moe_w4a4_flashinfer", mutates_args=())
def fused_moe_w4a4_flashinfer_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    hidden: int,
    intermediate: int,
    expert_offset: int,
    global_experts: int,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """weights: ``MoEWeightsFlashInfer.tensors()``; inputs already checked by api.fused_moe_w4a4.  CPU tensors run
    the reference on the same weights (only local experts contribute, as with an expert map)."""
    from .flashinfer_moe import MoEWeightsFlashInfer, fused_moe_w4a4_flashinfer

    packed = MoEWeightsFlashInfer.from_tensors(weights, hidden, intermediate, expert_offset)
    if select_backends(x.device).moe_w4a4 is TORCH:
        from .reference import fused_moe_torch

        w13, w2 = packed.to_nvfp4()
        local = torch.arange(packed.num_experts, dtype=torch.int32) + expert_offset
        expert_map = torch.full((global_experts,), -1, dtype=torch.int32).index_put_((local.long(),), local - expert_offset)
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                               w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale)  # fmt: skip
    return fused_moe_w4a4_flashinfer(x, packed, topk_weights, topk_ids, global_experts, (w13_input_scale, w2_input_scale))


@fused_moe_w4a4_flashinfer_op.register_fake
def _(x, weights, topk_weights, topk_ids, hidden, intermediate, expert_offset, global_experts, w13_input_scale,
      w2_input_scale):  # fmt: skip
    return torch.empty_like(x)
