"""The 128x4 blocked e4m3 scale layout inside Triton kernels (the host side is layouts.swizzle_scales_128x4)."""

from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401  (the interpreter wants triton.language in a jit function's module)

__all__ = ["swizzled_offset"]


@triton.jit
def swizzled_offset(i, j, col_blocks):
    """Byte offset of scale (row i, scale column j) in a matrix of ``col_blocks`` 4-column blocks: the formula of
    layouts.swizzled_offset, which takes the column count instead (its ceil division is Python's)."""
    return ((i // 128) * col_blocks + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
