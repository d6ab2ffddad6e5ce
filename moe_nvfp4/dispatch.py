"""Backend choice in one place, by the tensor's device capability; MOE_NVFP4_BACKEND overrides it."""
from __future__ import annotations

import os

import torch

__all__ = ["BACKENDS", "backend_for", "has_native_fp4_mma"]

BACKENDS = ("torch", "triton")


def has_native_fp4_mma(device: torch.device) -> bool:
    """Blackwell datacenter parts (sm_100/sm_103) have block-scaled FP4 tensor cores."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def backend_for(device: torch.device) -> str:
    """'triton' on CUDA GPUs of compute capability 8.0+ (sm_90 is the tuned target), 'torch' on CPU."""
    forced = os.environ.get("MOE_NVFP4_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"MOE_NVFP4_BACKEND={forced!r}; choose one of {BACKENDS}")
        return forced
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "triton"
    if device.type == "cpu":
        return "torch"
    raise RuntimeError(f"no NVFP4 MoE backend for device {device}; supported: CPU (reference), CUDA sm_80+")
