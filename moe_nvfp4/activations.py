"""Activation quantization, the entry point for both kernel families: the Blackwell MoE host quantizes its GEMM
inputs through it, below the API layer that re-exports it."""

from __future__ import annotations

import torch

from .dispatch import select_backends
from .formats import NVFP4, NVFP4Tensor, input_scale_or_nan

__all__ = ["quantize_activations"]


def _check_global_scale(name: str, scale: torch.Tensor, device: torch.device) -> None:
    """An activation global scale argument: one float32 value on the activations' device."""
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(
            f"{name} must be one float32 value on {device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )


def quantize_activations(x: torch.Tensor, input_global_scale: torch.Tensor) -> NVFP4Tensor:
    """Activations [M, K] (bf16, fp16 or fp32; K a multiple of 16) -> NVFP4 with 128x4-swizzled e4m3 scales,
    the layout block-scaled MMAs read.  ``input_global_scale``: one float32 value, ModelOpt's ``input_scale``
    (amax / (6 * 448), a multiplier; values past the calibrated range saturate at 6).

    NaN propagates as through a 16-bit GEMM, without a host synchronisation: a block of 16 holding NaN or inf
    gets a NaN block scale (e4m3 byte 0x7F) and codes 0, so it dequantizes to NaN; a global scale that is NaN,
    inf, <= 0 or outside ``formats.INPUT_SCALE_RANGE`` becomes NaN (``input_scale_or_nan``), so every block
    does.  CUDA: one Triton launch, no host synchronisation; CPU: the reference (``quantize_activations_nvfp4``,
    then ``swizzled_scales``).  Both give the same bytes.
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] % NVFP4.block_size:
        raise ValueError(f"x must be [M, K] with K a multiple of {NVFP4.block_size}, got {tuple(x.shape)}")
    _check_global_scale("input_global_scale", input_global_scale, x.device)
    gs = input_scale_or_nan(input_global_scale.reshape(()))
    return select_backends(x.device).quantize.entry("quantize")(x, gs)
