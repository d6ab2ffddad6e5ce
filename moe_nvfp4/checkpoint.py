"""Checkpoint conventions (ModelOpt, compressed-tensors) and validation with actionable errors.

ModelOpt:           weight (uint8 [N, K/2]), weight_scale (e4m3 [N, K/16]), weight_scale_2 (fp32, multiplier),
                    input_scale (fp32, multiplier)
compressed-tensors: weight_packed, weight_scale, weight_global_scale (= 1 / weight_scale_2),
                    input_global_scale (= 1 / input_scale)
Scalars may be 0-dim or [1]; both are accepted and returned 0-dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

import torch

from .formats import NVFP4, NVFP4Tensor, ScaleLayout
from .layouts import padded_scale_shape

__all__ = [
    "CheckpointError",
    "Convention",
    "NVFP4Linear",
    "TENSOR_NAMES",
    "any_bad_block_scale",
    "bad_scale_bytes",
    "detect_convention",
    "SCAN_CHUNK_BYTES",
    "from_checkpoint",
    "row_chunks",
    "to_checkpoint",
    "validate_nvfp4",
]


class CheckpointError(ValueError):
    """A checkpoint tensor is missing or wrong; the message names the tensor, the expert and the problem.

    ``tensor`` (the full tensor name) and ``reason`` are set where one tensor is at fault.
    """

    def __init__(self, message: str, *, tensor: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.reason = reason or message


def _error(tensor: str, expert: int | None, reason: str) -> CheckpointError:
    return CheckpointError(f"{_where(tensor, expert)}: {reason}", tensor=tensor, reason=reason)


class Convention(str, Enum):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


# Per convention: (packed values, block scale, global scale, input scale, whether scales are reciprocals).
TENSOR_NAMES: dict[Convention, tuple[str, str, str, str, bool]] = {
    Convention.MODELOPT: ("weight", "weight_scale", "weight_scale_2", "input_scale", False),
    Convention.COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", True),
}


@dataclass(frozen=True)
class NVFP4Linear:
    """One quantized linear layer as a checkpoint holds it; ``input_scale`` is a multiplier or None."""

    weight: NVFP4Tensor
    input_scale: torch.Tensor | None = None


def _where(name: str, expert: int | None) -> str:
    return f"{name} (expert {expert})" if expert is not None else name


def detect_convention(keys: Mapping[str, object] | set[str]) -> Convention:
    """Which convention a layer's tensor names follow (keys are the suffixes after the module prefix)."""
    if "weight_packed" in keys:
        return Convention.COMPRESSED_TENSORS
    if "weight" in keys and "weight_scale_2" in keys:
        return Convention.MODELOPT
    raise CheckpointError(f"not an NVFP4 layer: expected weight+weight_scale_2 or weight_packed, found {sorted(keys)}")


def _scalar(t: torch.Tensor, tensor: str, expert: int | None) -> torch.Tensor:
    if t.numel() != 1 or t.dim() > 1:
        raise _error(tensor, expert, f"expected a scalar (0-dim or [1]), got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise _error(tensor, expert, f"expected a floating-point scalar, got {t.dtype}")
    return t.reshape(()).float()


def from_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    convention: Convention | None = None,
    *,
    name: str = "layer",
    expert: int | None = None,
) -> NVFP4Linear:
    """Read one layer's tensors (keyed by suffix: ``weight``, ``weight_scale``, ...) and validate them.

    Scales are checked after conversion to multipliers (compressed-tensors stores reciprocals), so a stored
    1e-45 fails as the inf it becomes.
    """
    convention = convention or detect_convention(tensors)
    packed_key, scale_key, global_key, input_key, reciprocal = TENSOR_NAMES[convention]
    for key in (packed_key, scale_key, global_key):
        if key not in tensors:
            raise _error(f"{name}.{key}", expert, f"missing (layer has {sorted(tensors)})")
    scales = {global_key: tensors[global_key], **({input_key: tensors[input_key]} if input_key in tensors else {})}
    for key, t in scales.items():
        stored = _scalar(t, f"{name}.{key}", expert)
        scales[key] = 1.0 / stored if reciprocal else stored
        if not (bool(torch.isfinite(scales[key])) and float(scales[key]) > 0):
            what = f"1 / {key} = {float(scales[key]):.4g}" if reciprocal else f"{float(stored):.4g}"
            raise _error(f"{name}.{key}", expert, f"scale must be finite and positive as a multiplier, got {what}")
    global_scale, input_scale = scales[global_key], scales.get(input_key)
    weight = NVFP4Tensor(tensors[packed_key], tensors[scale_key], global_scale)
    validate_nvfp4(weight, name=name, expert=expert, tensor_names=(packed_key, scale_key, global_key))
    return NVFP4Linear(weight, input_scale)


def to_checkpoint(layer: NVFP4Linear, convention: Convention = Convention.MODELOPT) -> dict[str, torch.Tensor]:
    """The tensors one layer contributes to a checkpoint, keyed by suffix (scalars 0-dim)."""
    packed_key, scale_key, global_key, input_key, reciprocal = TENSOR_NAMES[convention]
    w = layer.weight.linear_scales()
    gs = w.global_scale.float().reshape(())
    out = {packed_key: w.packed, scale_key: w.block_scale, global_key: 1.0 / gs if reciprocal else gs}
    if layer.input_scale is not None:
        s = layer.input_scale.float().reshape(())
        out[input_key] = 1.0 / s if reciprocal else s
    return out


def validate_nvfp4(
    q: NVFP4Tensor,
    *,
    name: str = "layer",
    expert: int | None = None,
    expected_shape: tuple[int, int] | None = None,
    tensor_names: tuple[str, str, str] = ("weight", "weight_scale", "weight_scale_2"),
) -> None:
    """Raise CheckpointError naming the tensor and expert for any dtype, shape or scale problem.

    For a stacked tensor ``[E, N, K/2]`` the expert index of the first bad expert is reported.
    ``expected_shape`` is the unquantized (N, K).
    """
    packed_key, scale_key, global_key = tensor_names
    packed, scale, gs = q.packed, q.block_scale, q.global_scale
    batch = packed.shape[:-2]

    def fail(key: str, reason: str, bad: torch.Tensor | None = None) -> CheckpointError:
        """Name the tensor and the expert: the caller's, or the first bad one of a stacked tensor."""
        e = expert
        if bad is not None and len(batch):
            e = int(bad.reshape(batch.numel(), -1).any(-1).nonzero()[0, 0])
        return _error(f"{name}.{key}", e, reason)

    if packed.dtype != NVFP4.packed_dtype:
        raise fail(packed_key, f"dtype {packed.dtype}, expected torch.uint8 (two FP4 per byte)")
    if scale.dtype != NVFP4.scale_dtype:
        raise fail(scale_key, f"dtype {scale.dtype}, expected torch.float8_e4m3fn")
    if not gs.dtype.is_floating_point:
        raise fail(global_key, f"dtype {gs.dtype}, expected float32")
    if packed.dim() < 2:
        raise fail(packed_key, f"expected [..., N, K/2], got shape {tuple(packed.shape)}")
    n, k = q.n, q.k
    if k % NVFP4.block_size:
        raise fail(packed_key, f"K={k} is not a multiple of {NVFP4.block_size}")
    if expected_shape is not None and (n, k) != tuple(expected_shape):
        raise fail(
            packed_key, f"shape {tuple(packed.shape)} holds a [{n}, {k}] weight, expected {tuple(expected_shape)}"
        )
    sfk = k // NVFP4.block_size
    if q.scale_layout is ScaleLayout.LINEAR:
        want = (*packed.shape[:-2], n, sfk)
    else:
        want = (*packed.shape[:-2], *padded_scale_shape(n, sfk))
    if tuple(scale.shape) != want:
        raise fail(scale_key, f"shape {tuple(scale.shape)}, expected {want} for a [{n}, {k}] weight")
    if not (gs.shape == batch or (gs.shape[:-1] == batch and gs.dim() > 0 and n % gs.shape[-1] == 0)):
        raise fail(global_key, f"shape {tuple(gs.shape)} does not fit batch {tuple(batch)}")
    bad_gs = ~torch.isfinite(gs) | (gs <= 0)
    if bool(bad_gs.any()):
        got = gs[bad_gs].flatten()[:4].tolist()
        raise fail(global_key, f"global scale must be finite and positive, got {got}", bad_gs)
    if not bool(any_bad_block_scale(scale)):  # one host synchronisation for a stacked layer
        return
    for index, matrix in enumerate(scale.reshape(-1, *scale.shape[-2:])):  # the first bad matrix, for the message
        sf = matrix.float()
        nonfinite, negative = ~torch.isfinite(sf), sf < 0
        if bool((nonfinite | negative).any()):
            where = expert if not len(batch) else index
            if bool(nonfinite.any()):
                raise _error(f"{name}.{scale_key}", where, f"{int(nonfinite.sum())} block scales are NaN or inf")
            raise _error(f"{name}.{scale_key}", where, f"{int(negative.sum())} block scales are negative")


# Bytes a pass reads at once when scanning a stacked layer's tensors: bounds the temporaries (three bool masks of
# a chunk of scales: 24 MiB), not the answer.
SCAN_CHUNK_BYTES = 1 << 23


def row_chunks(t: torch.Tensor, rows: int | None = None) -> list[torch.Tensor]:
    """``t`` [..., C] as runs of ``rows`` rows [rows, C] (None: about SCAN_CHUNK_BYTES a run; views where ``t``
    allows)."""
    flat = t.reshape(-1, t.shape[-1])
    return list(flat.split(rows or max(1, SCAN_CHUNK_BYTES // max(1, flat.shape[1] * t.element_size()))))


def bad_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Where an e4m3 block scale is NaN (0x7F, 0xFF; e4m3fn has no inf) or negative (0x81-0xFE; -0.0 is zero),
    read from its bytes: no float temporaries."""
    b = scale.view(torch.uint8)
    return (b == 0x7F) | (b > 0x80)


def any_bad_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``scale``'s device: whether any block scale is NaN or negative (no host synchronisation)."""
    bad = torch.zeros((), dtype=torch.bool, device=scale.device)
    for chunk in row_chunks(scale):
        bad |= bad_scale_bytes(chunk).any()
    return bad
