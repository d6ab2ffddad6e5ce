"""The expert MLP's activation, as data: which function GEMM1's output goes through and whether GEMM1 is gated
(gate and up rows) or not.  Format-level: the weights object, the reference, the kernels and the vLLM
integration all read it; nothing here computes.

On GEMM1's float32 output row (bias added), with g the gate half and u the up half of a gated one:

* ``silu``: silu(g) * u.
* ``swiglu_oai`` (gpt-oss; vLLM's ``swigluoai_and_mul`` applied to de-interleaved halves): g = min(g, limit),
  u = clamp(u, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g).
* ``relu2`` (Nemotron-H; vLLM's ``relu2_no_mul``, not gated): relu(h)^2 on the whole row h; GEMM1 then has I
  rows per expert, not 2I.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ExpertActivation", "SILU", "SWIGLU_OAI", "RELU2", "ACTIVATION_NAMES"]

ACTIVATION_NAMES = ("silu", "swiglu_oai", "relu2")
_GATED = {"silu": True, "swiglu_oai": True, "relu2": False}


@dataclass(frozen=True)
class ExpertActivation:
    """``name`` one of ACTIVATION_NAMES; ``alpha`` and ``limit`` are swiglu_oai's sigmoid slope and clamp (vLLM's
    SwigluOAIAndMul defaults), carried but unused by the others."""

    name: str
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATION_NAMES:
            raise ValueError(f"unknown expert activation {self.name!r}; choose one of {', '.join(ACTIVATION_NAMES)}")
        for field, value in (("alpha", self.alpha), ("limit", self.limit)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ExpertActivation.{field} must be a finite number > 0, got {value!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "limit", float(self.limit))

    @property
    def gated(self) -> bool:
        """Whether GEMM1 computes gate and up rows (2I per expert) and the activation multiplies them."""
        return _GATED[self.name]


SILU = ExpertActivation("silu")
SWIGLU_OAI = ExpertActivation("swiglu_oai")
RELU2 = ExpertActivation("relu2")
