"""Scale layouts: the 128x4 blocked layout of cuBLASLt, CUTLASS and FlashInfer.

For row i and scale column j of an [N, SFK] scale matrix the byte sits at
``((i // 128) * ceil(SFK / 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4``,
with rows padded to 128 and columns to 4 (per expert when batched).  Padding bytes are zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkedNibbleLayout", "SCALE_LAYOUT_VERSION", "padded_scale_shape", "swizzle_scales_128x4", "unswizzle_scales_128x4", "swizzled_offset"]

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
    if scales.dim() < 2:
        raise ValueError(f"swizzle_scales_128x4: scales must be [..., N, SFK], got shape {tuple(scales.shape)}")
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
    if swizzled.dim() < 2:
        raise ValueError(f"unswizzle_scales_128x4: swizzled must be [..., M, C], got shape {tuple(swizzled.shape)}")
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


@dataclass(frozen=True)
class ChunkedNibbleLayout:
    """Weight layout of the sm_90 Triton MoE kernel.

    K is zero-padded to a multiple of ``chunk_k``.  Within each chunk of ``chunk_k`` K-elements, byte i
    holds element i in the low nibble and element i + chunk_k/2 in the high nibble, so the kernel decodes
    the two halves of a chunk as two dense [N, chunk_k/2] operands with no register shuffle.  Block scales
    stay linear ([..., N, KP/16], padded with zeros, which decode padded values to 0).
    """

    chunk_k: int = 128
    version: int = 1

    def padded_k(self, k: int) -> int:
        return -(-k // self.chunk_k) * self.chunk_k

    def pack(self, packed: torch.Tensor) -> torch.Tensor:
        """Standard packing [..., N, K/2] (even K in the low nibble) -> [..., N, KP/2] in this layout."""
        from .formats import unpack_fp4

        *batch, n, half_k = packed.shape
        kp = self.padded_k(2 * half_k)
        codes = unpack_fp4(packed)
        if kp != 2 * half_k:
            codes = torch.nn.functional.pad(codes, (0, kp - 2 * half_k))
        chunks = codes.reshape(*batch, n, kp // self.chunk_k, self.chunk_k)
        half = self.chunk_k // 2
        return (chunks[..., :half] | (chunks[..., half:] << 4)).reshape(*batch, n, kp // 2)

    def unpack(self, packed: torch.Tensor, k: int) -> torch.Tensor:
        """Inverse of ``pack``: [..., N, KP/2] -> standard packing [..., N, K/2]."""
        from .formats import pack_fp4

        *batch, n, half_kp = packed.shape
        if half_kp * 2 != self.padded_k(k):
            raise ValueError(f"packed K of {half_kp * 2} does not match K={k} padded to {self.padded_k(k)}")
        chunks = packed.reshape(*batch, n, half_kp * 2 // self.chunk_k, self.chunk_k // 2)
        codes = torch.cat((chunks & 0x0F, chunks >> 4), dim=-1).reshape(*batch, n, half_kp * 2)
        return pack_fp4(codes[..., :k])

    def pad_scales(self, scales: torch.Tensor, k: int) -> torch.Tensor:
        """Linear block scales [..., N, K/16] -> [..., N, KP/16], zero padded."""
        extra = (self.padded_k(k) - k) // 16
        return torch.nn.functional.pad(scales.view(torch.uint8), (0, extra)).view(scales.dtype) if extra else scales

    def unpad_scales(self, padded: torch.Tensor, k: int) -> torch.Tensor:
        """Inverse of ``pad_scales`` for e4m3 bits stored as uint8: [..., N, KP/16] -> e4m3 [..., N, K/16]."""
        return padded[..., : k // 16].contiguous().view(torch.float8_e4m3fn)
