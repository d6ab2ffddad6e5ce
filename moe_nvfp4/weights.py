"""``MoEWeights``: the MoE's expert weights in the layout of the kernels that read them (``weight_layouts``), one
type for every backend; ``Fp8ExpertWeights``: the opt-in W4A8 mode's e4m3 copy of them (design 008).  A module of
its own so the op layer builds them without importing the API that packs them; ``api`` re-exports MoEWeights."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .expert_activation import SILU, ExpertActivation
from .formats import NVFP4, NVFP4Tensor
from .layouts import padded_scale_shape, round_up
from .shapes import LayerShape
from .weight_layouts import (
    HIDDEN_ALIGN,
    INTERMEDIATE_ALIGN,
    FlashInferLayout,
    MoELayout,
    Sm90Layout,
    Sm100Layout,
    gate_up_rows,
    padded_intermediate,
)

__all__ = ["MoEWeights", "Fp8ExpertWeights"]


@dataclass(frozen=True)
class MoEWeights:
    """Expert weights in ``layout`` (``weight_layouts``; default ``sm90_fragments``: padN pads to 64, padK to 128).

    w13_packed uint8 [E, 2 padN(I), padK(H)/2] (gate rows, then up rows), w13_scale uint8
    [E, 2 padN(I), padK(H)/16], w13_global fp32 [E, 2] (gate, up); w2_packed [E, padN(H), padK(I)/2],
    w2_scale [E, padN(H), padK(I)/16], w2_global fp32 [E].  With a non-gated ``activation`` w13 is one padded
    block of I rows: [E, padN(I), ...], w13_global fp32 [E].  Biases (optional) float32: w13_bias [E, 2I] (gate
    then up; [E, I] non-gated), w2_bias [E, H], added to each GEMM's output before the activation and the routing
    weight.

    Built by ``api.prepare_moe_weights`` (or ``prepare_moe_weights_w4a4``); any other construction, including
    ``dataclasses.replace``, is checked here against the layout: every tensor's shape (from E, ``hidden``,
    ``intermediate`` and the activation), dtype, contiguity and device, so the kernels, which trust these fields,
    never read past a buffer.  Shapes only: no values are read (meta tensors pass).
    """

    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    hidden: int
    intermediate: int
    layout: MoELayout = Sm90Layout()  # a backend packs for its own (Backend.w4a16_layout, w4a4_layout)
    activation: ExpertActivation = SILU
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, MoELayout):
            raise TypeError(f"MoEWeights.layout must be a weight_layouts.MoELayout, got {self.layout!r}")
        if not isinstance(self.activation, ExpertActivation):
            raise TypeError(f"MoEWeights.activation must be an ExpertActivation, got {self.activation!r}")
        for name in ("hidden", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % NVFP4.block_size:
                raise ValueError(f"MoEWeights.{name} must be a positive multiple of {NVFP4.block_size}, got {value!r}")
        if not isinstance(self.w13_packed, torch.Tensor) or self.w13_packed.dim() != 3:
            raise ValueError(
                f"MoEWeights.w13_packed must be a [E, rows, K/2] tensor, got "
                f"{getattr(self.w13_packed, 'shape', type(self.w13_packed))}"
            )
        if self.num_experts < 1:
            raise ValueError("MoEWeights.w13_packed holds no experts (E=0)")
        if not isinstance(self.layout, Sm90Layout) and (
            self.activation.name != "silu" or self.w13_bias is not None or self.w2_bias is not None
        ):
            raise ValueError(
                f"MoEWeights in the {self.layout.name} layout (W4A4) run a gated SiLU without biases; "
                f"got activation {self.activation.name}, biases "
                f"{self.w13_bias is not None}/{self.w2_bias is not None}"
            )
        expected = _expected_tensors(
            self.layout, self.num_experts, self.hidden, self.intermediate, self.activation.gated
        )
        device = self.w13_packed.device
        for name, shape, dtype in expected:
            t = getattr(self, name)
            if t is None and name.endswith("_bias"):
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"MoEWeights.{name} must be a tensor, got {type(t).__name__}")
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(
                    f"MoEWeights.{name} must be {dtype} {shape} for E={self.num_experts}, "
                    f"hidden={self.hidden}, intermediate={self.intermediate} in the {self.layout.name} "
                    f"layout ({self.activation.name}); got {t.dtype} {tuple(t.shape)}"
                )
            if t.device != device:
                raise ValueError(f"MoEWeights.{name} is on {t.device}, w13_packed on {device}: one device for all")
            if not t.is_contiguous():
                raise ValueError(f"MoEWeights.{name} must be contiguous (the kernels compute its strides)")

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global): the custom ops' ``weights`` list."""
        return self.w13_packed, self.w13_scale, self.w13_global, self.w2_packed, self.w2_scale, self.w2_global

    def layer_shape(self, top_k: int, dtype: torch.dtype, expert_map: torch.Tensor | None = None) -> LayerShape:
        """What configs are chosen for when these weights run with ``top_k``, ``dtype`` activations and
        ``expert_map`` (its length is the routing's expert count)."""
        n_global = 0 if expert_map is None else expert_map.numel()
        return LayerShape(
            self.num_experts, top_k, self.hidden, self.intermediate, dtype, n_global, gated=self.activation.gated
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors, self.w13_bias, self.w2_bias) if t is not None)

    def to_nvfp4(self) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """Back to standard packing with linear e4m3 scales (for checks and the CPU reference)."""
        return self.layout.to_nvfp4(self)


@functools.lru_cache(maxsize=256)
def _expected_tensors(
    layout: MoELayout, e: int, h: int, i: int, gated: bool
) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """(field name, shape, dtype) of every tensor of ``MoEWeights`` with these dimensions in ``layout``, as its
    ``pack`` writes them (weight_layouts).  Cached: the custom ops rebuild and check a ``MoEWeights`` every call
    (eager calls skip the op since: api._through_op), and this was 8 of its 21 us on a CI core (2026-11-29)."""
    return tuple((name, shape, dtype) for name, (shape, dtype) in _tensor_rules(layout, e, h, i, gated).items())


def _tensor_rules(
    layout: MoELayout, e: int, h: int, i: int, gated: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    u8, e4m3, f32 = torch.uint8, NVFP4.scale_dtype, torch.float32
    common = {
        "w13_global": ((e, 2) if gated else (e,), f32),
        "w2_global": ((e,), f32),
        "w13_bias": ((e, 2 * i if gated else i), f32),
        "w2_bias": ((e, h), f32),
    }
    if isinstance(layout, Sm90Layout):
        f = layout.fragments
        rows13 = (2 if gated else 1) * f.padded_n(i)
        return {
            "w13_packed": ((e, rows13, f.padded_k(h) // 2), u8),
            "w13_scale": ((e, rows13, f.padded_k(h) // 16), u8),
            "w2_packed": ((e, f.padded_n(h), f.padded_k(i) // 2), u8),
            "w2_scale": ((e, f.padded_n(h), f.padded_k(i) // 16), u8),
            **common,
        }
    if isinstance(layout, Sm100Layout):
        if h % 32:
            raise ValueError(f"MoEWeights.hidden={h}; the {layout.name} layout needs a multiple of 32")
        i_pad, h_pad = padded_intermediate(i), h
    elif isinstance(layout, FlashInferLayout):
        i_pad, h_pad = round_up(i, INTERMEDIATE_ALIGN), round_up(h, HIDDEN_ALIGN)
    else:
        raise TypeError(f"MoEWeights: no shape rule for the {layout.name} layout")
    return {
        "w13_packed": ((e, 2 * i_pad, h_pad // 2), u8),
        "w13_scale": ((e, *padded_scale_shape(2 * i_pad, h_pad // 16)), e4m3),
        "w2_packed": ((e, h_pad, i_pad // 2), u8),
        "w2_scale": ((e, *padded_scale_shape(h_pad, i_pad // 16)), e4m3),
        **common,
    }


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """The folded e4m3 experts.  w13 float8_e4m3fn [E, 2 pad64(I), H] for a gated activation (FP8_GATE_UP_BLOCK
    gate rows, then those outputs' up rows, in turn; padding rows zero) or [E, I, H]; w2 [E, H, I]; w13_scale and
    w2_scale float32 per row (a weight is e4m3 x its row's scale).  ``source``: the MoEWeights folded (activation,
    biases, sizes)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    source: MoEWeights

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the custom op carries: (w13, w13_scale, w2, w2_scale); ``source`` travels as the op's W4A16 weights."""
        return self.w13, self.w13_scale, self.w2, self.w2_scale

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def w13_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 and its scales in the checkpoint's row order (gate rows, then up rows): [E, 2I or I, H], [E, 2I or I]."""
        if not self.source.activation.gated:
            return self.w13, self.w13_scale
        i = self.source.intermediate
        return gate_up_rows(self.w13.view(torch.uint8), i).view(torch.float8_e4m3fn), gate_up_rows(self.w13_scale, i)
