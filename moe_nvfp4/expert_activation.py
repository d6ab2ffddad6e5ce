"""The expert MLP's activation, as data: which function GEMM1's output goes through and whether GEMM1 is gated
(gate and up rows) or not.  Format-level: the weights object, the reference, the kernels and the vLLM
integration all read it.

On GEMM1's float32 output row (bias added), with g the gate half and u the up half of a gated one:

* ``silu``: silu(g) * u.
* ``swiglu_oai`` (gpt-oss; vLLM's ``swigluoai_and_mul`` applied to de-interleaved halves): g = min(g, limit),
  u = clamp(u, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g).
* ``relu2`` (Nemotron-H; vLLM's ``relu2_no_mul``, not gated): relu(h)^2 on the whole row h; GEMM1 then has I
  rows per expert, not 2I.

``ACTIVATIONS`` is the one table of them: each name's gatedness and its torch twin (the definition every test and
the CPU backend compute; ``ExpertActivation.torch_twin``).  A backend's kernels hold their own function per name (the
sm_90 GEMMs' float32 epilogue: ``sm90.common._activation``), told the name and gatedness by the object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

__all__ = ["ACTIVATIONS", "ACTIVATION_NAMES", "ExpertActivation", "RELU2", "SILU", "SWIGLU_OAI"]


def _silu_torch(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _swiglu_oai_torch(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _relu2_torch(h: torch.Tensor, up: None, alpha: float, limit: float) -> torch.Tensor:
    return torch.square(torch.relu(h))  # not gated: h is the whole row, there is no up half


class ActivationSpec(NamedTuple):
    """gated: GEMM1 computes gate and up rows (2I per expert) and the function takes both (else the whole row h
    and None); torch_twin: the definition (gate, up, alpha, limit) -> out, in its inputs' dtype."""

    gated: bool
    torch_twin: Callable[[torch.Tensor, torch.Tensor | None, float, float], torch.Tensor]


ACTIVATIONS = {
    "silu": ActivationSpec(True, _silu_torch),
    "swiglu_oai": ActivationSpec(True, _swiglu_oai_torch),
    "relu2": ActivationSpec(False, _relu2_torch),
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)


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
        return ACTIVATIONS[self.name].gated

    def torch_twin(self, h: torch.Tensor) -> torch.Tensor:
        """GEMM1's output rows h (bias added; [M, 2I] gate then up when gated, else [M, I]) -> [M, I], in h's dtype:
        the torch twin every kernel is compared with."""
        gate, up = h.chunk(2, dim=-1) if self.gated else (h, None)
        return ACTIVATIONS[self.name].torch_twin(gate, up, self.alpha, self.limit)


SILU = ExpertActivation("silu")
SWIGLU_OAI = ExpertActivation("swiglu_oai")
RELU2 = ExpertActivation("relu2")
