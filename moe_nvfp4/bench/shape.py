"""A bench case's layer (``MoEShape``: a name and the layer's shape, spelled as ``shapes.LayerShape``) and its
bytes (NVFP4 weights of the touched experts, activations) and FLOPs, declared once; ``harness`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from ..expert_activation import ExpertActivation
from ..shapes import LayerShape

__all__ = ["NVFP4_BLOCK", "MoEShape", "nvfp4_matrix_bytes"]

NVFP4_BLOCK = 16  # elements per e4m3 block scale


def nvfp4_matrix_bytes(n: int, k: int, *, global_scales: int = 1) -> int:
    """Bytes of one NVFP4 matrix [N, K]: packed e2m1 (K/2 per row) + e4m3 block scales (K/16 per row)
    + ``global_scales`` fp32 global scales."""
    if k % NVFP4_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {NVFP4_BLOCK}")
    return n * k // 2 + n * k // NVFP4_BLOCK + 4 * global_scales


@dataclass(frozen=True)
class MoEShape:
    """A bench case: ``name`` and one MoE layer's shape, its fields spelled as ``shapes.LayerShape`` (``layer``)
    spells them: ``experts`` local of ``global_experts`` routed (0: as many), top-k, hidden size H, intermediate size
    I (w13 is [2I, H] with a gated ``activation``, [I, H] without; w2 is [H, I]); ``activation`` an
    expert_activation name.  Activations are bf16."""

    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    renormalize: bool = True
    act_bytes: int = 2  # bf16 activations
    global_experts: int = 0  # the routing's experts under expert parallelism (``experts`` of them local)
    activation: str = "silu"

    def __post_init__(self) -> None:
        if not self.global_experts:
            object.__setattr__(self, "global_experts", self.experts)

    @property
    def expert_activation(self) -> ExpertActivation:
        return ExpertActivation(self.activation)

    @property
    def layer(self) -> LayerShape:
        """The layer as configs are chosen for it (bf16 activations)."""
        gated = self.expert_activation.gated
        return LayerShape(
            self.experts, self.top_k, self.hidden, self.intermediate, "bfloat16", self.global_experts, gated
        )

    @property
    def w13_rows(self) -> int:
        """GEMM1's rows per expert: gate and up (2I), or I for a non-gated activation."""
        return 2 * self.intermediate if self.expert_activation.gated else self.intermediate

    def flops(self, tokens: int) -> int:
        """2 * T * k * (2I*H + H*I) (I*H for GEMM1 when not gated) over the pairs whose expert is local (all without
        expert parallelism; the expected share with it, LayerShape.local_pairs, rounded): both GEMMs; the activation
        is ignored."""
        return round(self.layer.local_pairs(tokens) * self.layer.flops_per_pair())

    def expert_nvfp4_bytes(self) -> int:
        """Weight bytes of one expert in NVFP4: w13 [2I, H] ([I, H] not gated; one global scale) + w2 [H, I] (one)."""
        return nvfp4_matrix_bytes(self.w13_rows, self.hidden) + nvfp4_matrix_bytes(self.hidden, self.intermediate)

    def expert_bf16_bytes(self) -> int:
        return 2 * (self.w13_rows + self.intermediate) * self.hidden

    def activation_bytes(self, tokens: int) -> int:
        """The unavoidable activation traffic: read x [T, H] once, write out [T, H] once."""
        return 2 * tokens * self.hidden * self.act_bytes

    def hbm_bytes(self, tokens: int, touched_experts: int, *, include_activations: bool = True) -> int:
        """Minimum HBM traffic of the NVFP4 forward: every touched expert's packed weights, block scales and
        global scales read once (plus x in and out, unless told otherwise)."""
        if not 0 <= touched_experts <= self.experts:
            raise ValueError(f"touched_experts={touched_experts} outside [0, {self.experts}]")
        weights = touched_experts * self.expert_nvfp4_bytes()
        return weights + (self.activation_bytes(tokens) if include_activations else 0)

    def max_touched(self, tokens: int) -> int:
        return min(self.experts, tokens * self.top_k)

    @classmethod
    def from_zoo(cls, shape) -> "MoEShape":
        """A ``moe_nvfp4.zoo.ZooShape``: its name, its ``layer`` and its activation."""
        layer = shape.layer
        fields = dict(experts=layer.experts, top_k=layer.top_k, hidden=layer.hidden, intermediate=layer.intermediate)
        return cls(shape.name, **fields, global_experts=layer.global_experts, activation=shape.activation.name)
