"""Scale layouts: the 128x4 blocked layout of cuBLASLt, CUTLASS and FlashInfer.

For row i and scale column j of an [N, SFK] scale matrix the byte sits at
``((i // 128) * ceil(SFK / 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4``,
with rows padded to 128 and columns to 4 (per expert when batched).  Padding bytes are zero.
"""
from __future__ import annotations

import torch

__all__ = ["SCALE_LAYOUT_VERSION", "padded_scale_shape", "swizzle_scales_128x4", "unswizzle_scales_128x4", "swizzled_offset"]

SCALE_LAYOUT_VERSION = 1


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    return _ceil_to(rows, 128), _ceil_to(scale_cols, 4)


def swizzled_offset(i: torch.Tensor | int, j: torch.Tensor | int, scale_cols: int):
    """Byte offset of scale (i, j) in the blocked layout (the formula above, written out once)."""
    col_blocks = -(-scale_cols // 4)
    return ((i // 128) * col_blocks + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """[..., N, SFK] -> [..., pad128(N), pad4(SFK)] whose flat bytes are in blocked order."""
    *batch, rows, cols = scales.shape
    prow, pcol = padded_scale_shape(rows, cols)
    padded = scales.new_zeros((*batch, prow, pcol))
    padded[..., :rows, :cols] = scales
    # [.., rb, 4 (i%128//32), 32 (i%32), cb, 4 (j%4)] -> [.., rb, cb, 32, 4, 4]
    blocks = padded.reshape(*batch, prow // 128, 4, 32, pcol // 4, 4)
    nb = len(batch)
    perm = (*range(nb), nb, nb + 3, nb + 2, nb + 1, nb + 4)
    return blocks.permute(perm).reshape(*batch, prow, pcol).contiguous()


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales_128x4: [..., pad128(N), pad4(SFK)] -> [..., N, SFK]."""
    *batch, prow, pcol = swizzled.shape
    if (prow, pcol) != padded_scale_shape(rows, scale_cols):
        raise ValueError(
            f"swizzled scales of shape {(prow, pcol)} do not hold a [{rows}, {scale_cols}] scale matrix "
            f"(expected {padded_scale_shape(rows, scale_cols)})"
        )
    blocks = swizzled.reshape(*batch, prow // 128, pcol // 4, 32, 4, 4)
    nb = len(batch)
    perm = (*range(nb), nb, nb + 3, nb + 2, nb + 1, nb + 4)
    linear = blocks.permute(perm).reshape(*batch, prow, pcol)
    return linear[..., :rows, :scale_cols].contiguous()
