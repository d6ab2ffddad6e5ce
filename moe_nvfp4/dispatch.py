"""Backend choice in one place, by the tensor's device capability; MOE_NVFP4_BACKEND overrides it.

  cpu                       -> "torch"  (the reference ops)
  CUDA sm_100 / sm_103      -> "cute"   (Blackwell: block-scaled FP4 tensor cores, CuTe DSL kernels)
  other CUDA, sm_80 and up  -> "triton" (sm_90 is the tuned target: weights decoded in registers)

"cute" covers the W4A4 ops (the grouped GEMM and the W4A4 MoE); the ops it has no kernel for (the W4A16
fused MoE, the activation quantizer) run their Triton kernels on Blackwell too.
"""
from __future__ import annotations

import os

import torch

__all__ = ["BACKENDS", "backend_for", "has_native_fp4_mma", "sm_count"]

BACKENDS = ("torch", "triton", "cute")


def has_native_fp4_mma(device: torch.device) -> bool:
    """Blackwell datacenter parts (sm_100/sm_103) have block-scaled FP4 tensor cores."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def sm_count(device: torch.device, *, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids are sized from it); ``off_gpu`` stands in
    where kernels run under the Triton interpreter or plans are only inspected (CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else off_gpu


def backend_for(device: torch.device) -> str:
    """The backend for ``device`` (see the module docstring), or MOE_NVFP4_BACKEND when set."""
    forced = os.environ.get("MOE_NVFP4_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"MOE_NVFP4_BACKEND={forced!r}; choose one of {BACKENDS}")
        if forced == "cute" and not has_native_fp4_mma(device):
            raise ValueError(f"MOE_NVFP4_BACKEND=cute needs an sm_100/sm_103 GPU (block-scaled FP4 MMA); {device} "
                             "has none")  # fmt: skip
        return forced
    if has_native_fp4_mma(device):
        return "cute"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "triton"
    if device.type == "cpu":
        return "torch"
    raise RuntimeError(f"no NVFP4 MoE backend for device {device}; supported: CPU (reference), CUDA sm_80+")
