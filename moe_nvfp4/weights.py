"""``MoEWeights``: the MoE's expert weights in the layout of the kernels that read them (``weight_layouts``), one
type for every backend.  A module of its own so the op layer builds them without importing the API that packs
them; ``api`` re-exports it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import LayerShape
from .expert_activation import SILU, ExpertActivation
from .formats import NVFP4Tensor
from .weight_layouts import MoELayout, Sm90Layout

__all__ = ["MoEWeights", "LAYOUT"]

LAYOUT = Sm90Layout()


@dataclass(frozen=True)
class MoEWeights:
    """Expert weights in ``layout`` (``weight_layouts``; default ``sm90_fragments``: padN pads to 64, padK to 128).

    w13_packed uint8 [E, 2 padN(I), padK(H)/2] (gate rows, then up rows), w13_scale uint8
    [E, 2 padN(I), padK(H)/16], w13_global fp32 [E, 2] (gate, up); w2_packed [E, padN(H), padK(I)/2],
    w2_scale [E, padN(H), padK(I)/16], w2_global fp32 [E].  With a non-gated ``activation`` w13 is one padded
    block of I rows: [E, padN(I), ...], w13_global fp32 [E].  Biases (optional) float32: w13_bias [E, 2I] (gate
    then up; [E, I] non-gated), w2_bias [E, H], added to each GEMM's output before the activation and the routing
    weight.
    """

    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    hidden: int
    intermediate: int
    layout: MoELayout = LAYOUT
    activation: ExpertActivation = SILU
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global): the kernels' weight arguments."""
        return self.w13_packed, self.w13_scale, self.w13_global, self.w2_packed, self.w2_scale, self.w2_global

    @property
    def variant(self) -> dict:
        """The expert-MLP variant as the host wrapper's keywords (triton.moe_sm90.fused_moe_sm90): activation, biases."""
        return dict(activation=self.activation, w13_bias=self.w13_bias, w2_bias=self.w2_bias)

    def layer_shape(self, top_k: int, dtype: torch.dtype, expert_map: torch.Tensor | None = None) -> LayerShape:
        """What configs are chosen for when these weights run with ``top_k``, ``dtype`` activations and
        ``expert_map`` (its length is the routing's expert count)."""
        n_global = 0 if expert_map is None else expert_map.numel()
        return LayerShape(self.num_experts, top_k, self.hidden, self.intermediate, dtype, n_global,
                          gated=self.activation.gated)  # fmt: skip

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors, self.w13_bias, self.w2_bias) if t is not None)

    def to_nvfp4(self) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """Back to standard packing with linear e4m3 scales (for checks and the CPU reference)."""
        return self.layout.to_nvfp4(self)
