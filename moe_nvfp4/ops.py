"""torch.library custom ops with fake implementations, so torch.compile and CUDA graphs see one opaque op."""
from __future__ import annotations

import torch

from .dispatch import select_backends
from .weight_layouts import weight_layout
from .weights import MoEWeights

__all__ = ["fused_moe_op", "fused_moe_w4a4_op"]


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
) -> torch.Tensor:
    """Tensors as in weights.MoEWeights; inputs already checked by api.fused_moe."""
    hidden = x.shape[1]
    if select_backends(x.device).moe_w4a16.reference:
        from .weights import MoEWeights
        from .reference import fused_moe_torch

        weights = MoEWeights(w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, hidden, intermediate)
        w13, w2 = weights.to_nvfp4()
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)
    from .configs import LayerShape, device_traits, select_config
    from .triton.moe_sm90 import fused_moe_sm90

    shape = LayerShape(w13_packed.shape[0], topk_ids.shape[1], hidden, intermediate, x.dtype,
                       0 if expert_map is None else expert_map.numel())  # fmt: skip
    config = select_config(x.shape[0], shape, device_traits(x.device))
    return fused_moe_sm90(
        x, w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, topk_weights, topk_ids,
        expert_map, intermediate, config,
    )  # fmt: skip


@fused_moe_op.register_fake
def _(x, w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, topk_weights, topk_ids, expert_map,
      intermediate):  # fmt: skip
    return torch.empty_like(x)


@torch.library.custom_op("moe_nvfp4::fused_moe_w4a4", mutates_args=())
def fused_moe_w4a4_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    hidden: int,
    intermediate: int,
    layout: str,
    expert_offset: int,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """weights: ``MoEWeights.tensors`` in the layout called ``layout``; inputs already checked (the layout against
    the backend too) by api.fused_moe_w4a4.  Runs the device's W4A4 backend (``Backend.entry``)."""
    packed = MoEWeights(*weights, hidden=hidden, intermediate=intermediate, layout=weight_layout(layout, expert_offset))
    run = select_backends(x.device).moe_w4a4.entry("moe_w4a4")
    return run(x, packed, topk_weights, topk_ids, expert_map, (w13_input_scale, w2_input_scale))


@fused_moe_w4a4_op.register_fake
def _(x, weights, topk_weights, topk_ids, expert_map, hidden, intermediate, layout, expert_offset, w13_input_scale,
      w2_input_scale):  # fmt: skip
    return torch.empty_like(x)
