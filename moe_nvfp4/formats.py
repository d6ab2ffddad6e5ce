"""The NVFP4 format: e2m1 values, e4m3 block scales, one fp32 global scale.

A dequantized element is ``e2m1(code) * float(block_scale) * global_scale``.  Values are packed two per
byte with the even K index in the low nibble; one e4m3 scale covers 16 consecutive K elements.  The
global scale follows ModelOpt (``weight_scale_2 = amax / (6 * 448)``, a *multiplier*);
compressed-tensors stores its reciprocal (``weight_global_scale``).

Everything here is plain torch and runs on any device.  Batched tensors carry leading dimensions
(experts) before ``[N, K]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from .layouts import pack_fp4, padded_scale_shape, swizzle_scales_128x4, unpack_fp4, unswizzle_scales_128x4

__all__ = [
    "NVFP4",
    "NVFP4Format",
    "NVFP4Tensor",
    "ScaleLayout",
    "E2M1_VALUES",
    "encode_e2m1",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "global_scale_for",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_activations_nvfp4",
    "INPUT_SCALE_RANGE",
    "input_scale_or_nan",
    "grouped_operands",
]


@dataclass(frozen=True)
class NVFP4Format:
    """Describes the format as data, so kernels and checkpoints never infer it from a dtype."""

    block_size: int = 16
    value_max: float = 6.0  # largest e2m1 magnitude
    scale_max: float = 448.0  # largest finite e4m3 value
    scale_dtype: torch.dtype = torch.float8_e4m3fn
    packed_dtype: torch.dtype = torch.uint8
    version: int = 1


NVFP4 = NVFP4Format()


class ScaleLayout(str, Enum):
    """Where the e4m3 block scales sit in memory."""

    LINEAR = "linear"  # [..., N, K/16], row-major
    SWIZZLED_128x4 = "swizzled_128x4"  # cuBLASLt/CUTLASS blocked layout, see layouts.py


# Magnitudes of the 8 e2m1 codes; code | 8 is the negative.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES), dtype=torch.float32)

# Rounding boundaries between consecutive magnitudes, and whether a tie rounds up.  Ties go to the
# even code (even mantissa bit): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 code (ties to even, saturating at 6); uint8 codes 0..15.

    The sign bit follows ``signbit(x)``, so negative values that round to zero give code 8 (-0).
    """
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for boundary, tie_up in _BOUNDARIES:
        above = mag >= boundary if tie_up else mag > boundary
        code += above.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized matrix (or a stack of them, one per expert).

    packed:       uint8 [..., N, K/2]
    block_scale:  float8_e4m3fn [..., N, K/16] (LINEAR) or [..., pad128(N), pad4(K/16)] (SWIZZLED_128x4,
                  the bytes in blocked order)
    global_scale: float32 [...] or [..., S]; with S segments, rows n of segment n // (N / S) share one
                  scale (S = 2 keeps the gate and up halves of a fused w13 exact).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    scale_layout: ScaleLayout = ScaleLayout.LINEAR

    @property
    def n(self) -> int:
        return self.packed.shape[-2]

    @property
    def k(self) -> int:
        return self.packed.shape[-1] * 2

    @property
    def batch_shape(self) -> torch.Size:
        return self.packed.shape[:-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.block_scale, self.global_scale))

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        return NVFP4Tensor(
            self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device), self.scale_layout
        )

    def linear_scales(self) -> "NVFP4Tensor":
        """The same tensor with LINEAR block scales."""
        if self.scale_layout is ScaleLayout.LINEAR:
            return self
        linear = unswizzle_scales_128x4(self.block_scale, self.n, self.k // NVFP4.block_size)
        return NVFP4Tensor(self.packed, linear, self.global_scale, ScaleLayout.LINEAR)

    def swizzled_scales(self) -> "NVFP4Tensor":
        """The same tensor with SWIZZLED_128x4 block scales."""
        if self.scale_layout is ScaleLayout.SWIZZLED_128x4:
            return self
        return NVFP4Tensor(
            self.packed, swizzle_scales_128x4(self.block_scale), self.global_scale, ScaleLayout.SWIZZLED_128x4
        )


def global_scale_for(x: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """ModelOpt global scale ``amax / (6 * 448)`` in float32, one per leading batch index.

    An all-zero (or empty) tensor gets 1.0, so the scale stays a valid (positive) multiplier.
    """
    batch = x.shape[:batch_dims]
    flat = x.detach().abs().float().reshape(*batch, math.prod(x.shape[batch_dims:]))
    amax = flat.amax(dim=-1) if flat.shape[-1] else flat.new_zeros(batch)  # empty: like all zeros
    # Divide by a tensor, not a Python number: CUDA turns division by a scalar into multiplication by its
    # reciprocal, one ulp away from the CPU result, and checkpoints converted on either must be identical.
    scale = amax / torch.full_like(amax, NVFP4.value_max * NVFP4.scale_max)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _row_scales(global_scale: torch.Tensor, batch_shape: torch.Size, n: int) -> torch.Tensor:
    """Global scales of shape batch_shape or batch_shape + (S,) -> [*batch_shape, N, 1] float32."""
    gs = global_scale.float()
    if gs.shape == batch_shape:
        gs = gs.unsqueeze(-1)
    segments = gs.shape[-1]
    if gs.shape[:-1] != batch_shape or n % segments:
        raise ValueError(
            f"global_scale of shape {tuple(global_scale.shape)} does not fit {tuple(batch_shape)} batches of {n} rows"
        )
    return gs.repeat_interleave(n // segments, dim=-1).unsqueeze(-1)


def _matrix_shape(w: torch.Tensor, name: str) -> tuple[torch.Size, int, int]:
    """(batch shape, N, K) of a float ``[..., N, K]`` argument, K a multiple of the block size."""
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() < 2:
        raise ValueError(f"{name}: expected [..., N, K], got shape {tuple(w.shape)}")
    *batch, n, k = w.shape
    if k % NVFP4.block_size:
        raise ValueError(f"{name}: K={k} is not a multiple of {NVFP4.block_size}")
    return torch.Size(batch), n, k


def _quantize(wf: torch.Tensor, row_scale: torch.Tensor, poison_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[..., N, K]`` and its per-row global scales ``[..., N, 1]`` -> (packed, e4m3 block scales).
    ``poison_nonfinite``: a block holding NaN or inf, or under a NaN global scale, gets a NaN scale (e4m3 byte
    0x7F) and codes 0, so it dequantizes to NaN (otherwise NaN would encode as 0 and inf saturate)."""
    *batch, n, k = wf.shape
    blocks = wf.reshape(*batch, n, k // NVFP4.block_size, NVFP4.block_size)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / (NVFP4.value_max * row_scale)).clamp(max=NVFP4.scale_max)
    scale_f = scale.to(NVFP4.scale_dtype).float()  # rounded to e4m3
    scale_f = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = encode_e2m1(blocks / (scale_f * row_scale).unsqueeze(-1))
    if poison_nonfinite:
        poisoned = ~torch.isfinite(blocks).all(dim=-1) | torch.isnan(row_scale)
        scale_f = torch.where(poisoned, float("nan"), scale_f)
        codes = torch.where(poisoned.unsqueeze(-1), 0, codes)
    return pack_fp4(codes.reshape(*batch, n, k)), scale_f.to(NVFP4.scale_dtype)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None, *, segments: int = 1) -> NVFP4Tensor:
    """Quantize a float weight ``[..., N, K]`` to NVFP4 with LINEAR scales.

    global_scale: float32 ``[...]`` (or ``[..., S]``), or one 0-dim value for every batch index; by default
    ``amax / (6 * 448)`` per batch index, or per row segment when ``segments`` > 1 (gate and up of a fused w13
    with their own scales).  Block scale = ``block_amax / (6 * global_scale)`` rounded to e4m3; a block whose
    scale is zero (all zeros, or too small to represent) gets 1.0 and quantizes to zeros.

    Weights are quantized once, at load or conversion time, so their values are checked here (one host
    synchronisation): NaN or inf in ``w`` and a global scale that is not finite and positive are ValueErrors
    (NVFP4 has no code for them: NaN would quantize to 0).
    """
    batch_shape, n, k = _matrix_shape(w, "quantize_nvfp4: w")
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"quantize_nvfp4: segments must be an int >= 1, got {segments!r}")
    if n % segments:
        raise ValueError(f"quantize_nvfp4: N={n} does not split into {segments} segments")
    nonfinite = ~torch.isfinite(w)
    if bool(nonfinite.any()):
        where = tuple(nonfinite.nonzero()[0].tolist())
        raise ValueError(
            f"quantize_nvfp4: w has {int(nonfinite.sum())} NaN/inf values (the first at {where}); "
            "NVFP4 has no code for them"
        )
    wf = w.float()
    if global_scale is None:
        seg = wf.reshape(*batch_shape, segments, n // segments, k)
        global_scale = global_scale_for(seg, batch_dims=len(batch_shape) + 1)
        if segments == 1:
            global_scale = global_scale.squeeze(-1)
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"quantize_nvfp4: global_scale must be a tensor, got {type(global_scale).__name__}")
    global_scale = global_scale.float().to(w.device)
    if global_scale.dim() == 0 and batch_shape:  # one scale for every batch index
        global_scale = global_scale.expand(batch_shape).contiguous()
    row_scale = _row_scales(global_scale, batch_shape, n)  # [..., N, 1]
    bad = ~torch.isfinite(global_scale) | (global_scale <= 0)
    if bool(bad.any()):
        got = global_scale[bad].flatten()[:4].tolist()
        raise ValueError(f"quantize_nvfp4: global_scale must be finite and positive, got {got}")
    packed, block_scale = _quantize(wf, row_scale, poison_nonfinite=False)
    return NVFP4Tensor(packed, block_scale, global_scale)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 -> float ``[..., N, K]`` (computed in float32, exact, then cast)."""
    q = q.linear_scales()
    n, k = q.n, q.k
    batch = q.batch_shape
    values = decode_e2m1(unpack_fp4(q.packed)).reshape(*batch, n, k // NVFP4.block_size, NVFP4.block_size)
    scaled = values * q.block_scale.float().unsqueeze(-1) * _row_scales(q.global_scale, batch, n).unsqueeze(-1)
    return scaled.reshape(*batch, n, k).to(dtype)


# An activation global scale (ModelOpt's input_scale: calibrated amax / (6 * 448)) outside this range cannot come
# from a calibration: below it every activation above 6 * 448 * 2^-40 (2.4e-9) saturates to one code, above it every
# activation below 2^-10 * 2^40 (1e9) quantizes to zero.  ``input_scale_or_nan`` turns such a scale into NaN.
INPUT_SCALE_RANGE = (2.0**-40, 2.0**40)


def input_scale_or_nan(scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale`` where it lies in INPUT_SCALE_RANGE, NaN elsewhere (NaN, inf, zero, negative, absurdly
    small or large).  Elementwise on the scale's device: activation scales arrive with every forward, where a check
    on the host would synchronise (and break CUDA-graph capture), so a bad one makes the output NaN instead of
    zeros or a flipped sign."""
    scale = scale.float()
    lo, hi = INPUT_SCALE_RANGE
    return torch.where((scale >= lo) & (scale <= hi), scale, float("nan"))


def quantize_activations_nvfp4(x: torch.Tensor, input_global_scale: torch.Tensor) -> NVFP4Tensor:
    """Quantize activations ``[M, K]`` with a fixed (calibrated) global input scale.

    input_global_scale follows ModelOpt's ``input_scale`` (a multiplier, ``amax / (6 * 448)``); it is a
    0-dim or [1] float32 tensor.  Block scales are LINEAR; values past the calibrated range saturate.
    NaN propagates, as through a 16-bit GEMM: a block holding NaN or inf gets a NaN block scale (codes 0),
    and a scale outside INPUT_SCALE_RANGE becomes NaN (``input_scale_or_nan``), so all of x dequantizes to NaN.
    """
    batch_shape, n, _ = _matrix_shape(x, "quantize_activations_nvfp4: x")
    if not isinstance(input_global_scale, torch.Tensor) or input_global_scale.numel() != 1:
        raise ValueError(
            f"quantize_activations_nvfp4: input_global_scale must be a tensor of one value, got "
            f"{getattr(input_global_scale, 'shape', type(input_global_scale))}"
        )
    gs = input_scale_or_nan(input_global_scale.reshape(()).to(x.device))
    gs = gs.expand(batch_shape).contiguous() if batch_shape else gs
    packed, block_scale = _quantize(x.float(), _row_scales(gs, batch_shape, n), poison_nonfinite=True)
    return NVFP4Tensor(packed, block_scale, gs)


def grouped_operands(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], alpha: torch.Tensor | None
) -> tuple[tuple[list[torch.Tensor], ...], torch.Tensor]:
    """Checked grouped-GEMM operands (``api.grouped_gemm_nvfp4``) as every backend's planner reads them:
    ((A packed, A swizzled scales, B packed, B swizzled scales) per group, contiguous; float32 [G] scale = A's
    global x B's global (x alpha))."""
    a_sw = [t.swizzled_scales() for t in a]
    b_sw = [t.swizzled_scales() for t in b]
    for g, (ag, bg) in enumerate(zip(a_sw, b_sw)):
        for name, t in (("A", ag), ("B", bg)):
            want = padded_scale_shape(t.n, t.k // NVFP4.block_size)
            if tuple(t.block_scale.shape) != want:
                raise ValueError(
                    f"group {g}: {name} swizzled scales have shape {tuple(t.block_scale.shape)}, expected {want}"
                )
    scale = torch.stack(
        [ag.global_scale.float().reshape(()) * bg.global_scale.float().reshape(()) for ag, bg in zip(a, b)]
    )
    if alpha is not None:
        scale = scale * alpha
    operands = (
        [t.packed.contiguous() for t in a_sw],
        [t.block_scale.contiguous() for t in a_sw],
        [t.packed.contiguous() for t in b_sw],
        [t.block_scale.contiguous() for t in b_sw],
    )
    return operands, scale
