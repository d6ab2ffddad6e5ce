"""What the sm_90 MoE compiles for a layer (the ``warmup_token_counts`` entry): the token counts whose forwards
compile every kernel variant ``fused_moe`` can launch up to ``max_tokens`` tokens (``warmup.compile_kernels`` runs
them, in threads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..shapes import device_traits
from ..triton.routing_kernels import routing_variants_from
from .tuned_configs import configs_up_to
from .w4a8 import fp8_first_tokens

if TYPE_CHECKING:
    from ..weights import MoEWeights

__all__ = ["warmup_token_counts"]


def warmup_token_counts(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    expert_map: torch.Tensor | None = None,
    fp8: bool = False,
) -> list[int]:
    """The fewest tokens of each config ``select_config`` serves up to ``max_tokens`` (``configs_up_to``) and of
    each routing variant; with ``fp8`` (forwards given the W4A8 mode's e4m3 copy) also the fewest at which that
    mode runs (w4a8.fp8_pays: one config and kernels compiled for every token count from there)."""
    device = weights.w13_packed.device
    first = configs_up_to(max_tokens, weights.layer_shape(top_k, dtype, expert_map), device_traits(device))
    counts = set(first.values()) | {min(max_tokens, t) for t in routing_variants_from(top_k)}
    if fp8:
        w4a8 = fp8_first_tokens(top_k, weights.num_experts if expert_map is None else expert_map.numel())
        counts |= {w4a8} if w4a8 <= max_tokens else set()
    return sorted(counts)
