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
    shape = weights.layer_shape(top_k, dtype, expert_map)
    first = configs_up_to(max_tokens, shape, device_traits(weights.w13_packed.device))
    counts = set(first.values()) | {min(max_tokens, t) for t in routing_variants_from(top_k)}
    w4a8 = fp8_first_tokens(top_k, shape.global_experts)
    if fp8 and w4a8 <= max_tokens:
        counts.add(w4a8)
    return sorted(counts)
