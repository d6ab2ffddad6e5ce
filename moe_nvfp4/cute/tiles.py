"""The tile sizes and dtype names shared by the sm_100a kernels' host side and their device code.  Apart from both
so the device modules (which import cutlass) take them without importing the host modules that build them."""

from __future__ import annotations

import torch

from ..layouts import GATE_UP_BLOCK

__all__ = ["TILE_M", "TILE_K", "SF_VEC", "GATE_UP_BLOCK"]

TILE_M = 128  # rows of A per tile: one CTA's tcgen05 MMA M (cta_group::1)
TILE_K = 256  # FP4 elements of K per smem stage: 4 MMAs of K = 64
SF_VEC = 16  # NVFP4: one e4m3 scale per 16 K-elements
_OUT_DTYPES = {torch.float16: "Float16", torch.bfloat16: "BFloat16", torch.float32: "Float32"}
