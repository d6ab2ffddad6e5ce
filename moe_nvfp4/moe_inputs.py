"""A MoE forward's activations and routing checked (metadata only: no host synchronisation) and put in the forms
the kernels read, once, at the API: the one cast of the routing ids (int64 ids past int32 saturate out of range
instead of wrapping onto an expert), the router weights in float32, x with rows the kernels can read."""

from __future__ import annotations

import torch


__all__ = ["MAX_TOP_K", "check_inputs", "int32_saturated", "kernel_inputs"]

MAX_TOP_K = 16


def check_inputs(
    x: torch.Tensor,
    hidden: int,
    num_experts: int,
    weights_device: torch.device,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> None:
    """Metadata checks only (no host synchronisation): the values of topk_ids and expert_map are never read here.
    Ids outside [0, E_global) and map entries outside [0, E) are not errors: they route the pair nowhere
    (routing.routed_pairs), masked in the kernels, so a corrupt id costs its pair, never memory safety."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"topk_ids must be [T={x.shape[0]}, k<={MAX_TOP_K}], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    devices = {t.device for t in (x, topk_weights, topk_ids)} | {weights_device}
    if len(devices) != 1:
        raise ValueError(f"x, weights and routing tensors must be on one device, got {devices}")
    if expert_map is None:
        return
    if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"expert_map must be a 1-D int32 or int64 tensor, got {expert_map.dtype} {tuple(expert_map.shape)}"
        )
    if expert_map.device != topk_ids.device:
        raise ValueError(
            f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}: they must share a device"
        )
    # Its length is the global expert count the ids index: one entry per global expert, so at least the local ones.
    if expert_map.numel() < num_experts:
        raise ValueError(
            f"expert_map has {expert_map.numel()} entries but the weights hold {num_experts} local "
            "experts: it needs one entry per global expert (the ids' range)"
        )


def kernel_inputs(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """What the kernels read, checked inputs in their forms: x with unit stride along H (its rows' 16-byte alignment
    is the op's to check: ops._readable_rows), topk_weights float32, topk_ids int32, expert_map contiguous int32.
    A strided x (``x[:, ::2]``) is a valid tensor, so it is copied, not refused; the copy of [T, H] costs little
    beside the expert weights every forward streams and has a fixed shape, so it captures in a CUDA graph.  int64 ids and entries past int32 saturate (to -1 or int32's max, both
    out of range) instead of wrapping onto a valid expert.  topk_weights and topk_ids are made contiguous (once,
    after the cast, which copies anyway when it converts): the kernels index them by flat pair t * k + j, so a
    strided view (``ids[:, :1]``, every other row, a column slice of a wider buffer) would be read as other
    pairs' values; the copy is [T, k], fixed-size, graph-capturable."""
    if x.stride(-1) != 1:
        x = x.clone(memory_format=torch.contiguous_format)  # .contiguous() keeps a one-row view's row stride
    emap = None if expert_map is None else int32_saturated(expert_map).contiguous()
    return x, topk_weights.float().contiguous(), int32_saturated(topk_ids).contiguous(), emap


def int32_saturated(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.clamp(-1, 2**31 - 1).to(torch.int32)
