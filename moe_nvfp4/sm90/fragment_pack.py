"""Packing matrices into the sm_90 fragment layout on the GPU (``layouts.FragmentLayout``; its ``pack`` is the
torch twin, bit for bit).  One launch for a run of experts' blocks and no temporaries: the torch twin runs about
130 small ops a matrix and holds about 13 bytes a weight while it works, which at load is millions of launches for
a many-expert model (Qwen3-30B-A3B: 18k matrices) and a spike of ~26x an expert matrix's bytes.
weight_layouts.Sm90Layout.pack calls it per gate/up block and run of experts (design 001).
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from ..formats import NVFP4
from ..layouts import FRAGMENT_WORD_BITS, FragmentLayout, encode_scale_e5m3

__all__ = ["agrees_with_twin", "block_packer", "pack_fragment_block"]


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bit positions int32 [8 * 4]: FRAGMENT_WORD_BITS, e4m3 byte -> e5m3 byte uint8 [256]) on ``device``, made
    once per device.  A byte that is not a finite non-negative e4m3 maps to 0; the validator refuses such scales
    before packing."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(NVFP4.scale_dtype).float()
    valid = torch.isfinite(e4m3) & (e4m3 >= 0)
    e5m3 = torch.where(valid, encode_scale_e5m3(torch.where(valid, e4m3, 0.0)), 0).to(torch.uint8)
    bits = torch.tensor(FRAGMENT_WORD_BITS, dtype=torch.int32).reshape(-1)
    return bits.to(device), e5m3.to(device)


@triton.jit
def _pack_fragments_kernel(
    src_ptr,
    src_scale_ptr,
    dst_ptr,
    dst_scale_ptr,
    bits_ptr,
    e5m3_ptr,
    n,
    k,
    src_stride,
    scale_stride,
    chunks,
    src_matrix_stride,
    scale_matrix_stride,
    dst_matrix_words,
    dst_scale_matrix_stride,
):
    """One (unit, chunk) tile of one matrix a program (axis 1: the matrix of the run): 1024 words, each the 8 codes FragmentLayout puts there (row = 64 unit +
    16 warp + 8 rh + r, k = 128 chunk + 16 g + 8 kh + 2 q + kp for word (slot = 32 warp + 4 r + q, g) and value
    j = 4 rh + 2 kh + kp), code bits at FRAGMENT_WORD_BITS[j]; codes of a zero-scale block and of the padding
    are 0.  Then the tile's 512 scale bytes, (warp, r, g, rh) order, e5m3."""
    tile, matrix = tl.program_id(0), tl.program_id(1).to(tl.int64)
    src_ptr += matrix * src_matrix_stride
    src_scale_ptr += matrix * scale_matrix_stride
    dst_ptr += matrix * dst_matrix_words
    dst_scale_ptr += matrix * dst_scale_matrix_stride
    unit, chunk = tile // chunks, tile % chunks
    w = tl.arange(0, 1024)
    slot, g = w // 8, w % 8
    warp, r, q = slot // 32, (slot // 4) % 8, slot % 4
    word = tl.zeros([1024], dtype=tl.int32)
    for j in tl.static_range(8):
        row = unit * 64 + warp * 16 + (j // 4) * 8 + r
        col = chunk * 128 + g * 16 + ((j // 2) % 2) * 8 + q * 2 + j % 2
        inside = (row < n) & (col < k)
        byte = tl.load(src_ptr + row.to(tl.int64) * src_stride + col // 2, mask=inside, other=0).to(tl.int32)
        scale = tl.load(src_scale_ptr + row.to(tl.int64) * scale_stride + col // 16, mask=inside, other=0)
        code = tl.where((scale.to(tl.int32) & 0x7F) == 0, 0, (byte >> (4 * (j % 2))) & 0xF)
        for b in tl.static_range(4):
            word |= ((code >> b) & 1) << tl.load(bits_ptr + j * 4 + b)
    tl.store(dst_ptr + tile.to(tl.int64) * 1024 + w, word)
    s = tl.arange(0, 512)
    pair = s // 16  # (warp, r)
    scale_row = unit * 64 + (pair // 8) * 16 + (s % 2) * 8 + pair % 8
    scale_col = chunk * 8 + (s // 2) % 8
    on = (scale_row < n) & (scale_col < k // 16)
    byte = tl.load(src_scale_ptr + scale_row.to(tl.int64) * scale_stride + scale_col, mask=on, other=0)
    tl.store(dst_scale_ptr + tile.to(tl.int64) * 512 + s, tl.load(e5m3_ptr + byte.to(tl.int32)))


def pack_fragment_block(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dst: torch.Tensor,
    dst_scales: torch.Tensor,
    layout: FragmentLayout = FragmentLayout(),
) -> None:
    """``layout.pack(packed, scales)`` of each matrix written into ``dst`` uint8 [..., NP, KP/2] and ``dst_scales``
    uint8 [..., NP, KP/16] (each matrix contiguous, matrices at any stride; they must not overlap the inputs):
    packed uint8 [..., N, K/2], scales e4m3 [..., N, K/16] (one leading dimension at most), rows of each
    contiguous.  One launch."""
    if packed.dim() == 2:
        packed, scales, dst, dst_scales = packed[None], scales[None], dst[None], dst_scales[None]
    if packed.dim() != 3:
        raise ValueError(f"packed must be [N, K/2] or [E, N, K/2], got {tuple(packed.shape)}")
    e, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    np_, kp = layout.padded_n(n), layout.padded_k(k)
    if k % 16 or tuple(scales.shape) != (e, n, k // 16):
        raise ValueError(f"scales {tuple(scales.shape)} must be [{n}, K/16] for packed {tuple(packed.shape)} (K={k})")
    if (layout.unit_rows, layout.chunk_k) != (64, 128):
        raise ValueError(f"the kernel packs 64-row units and 128-wide chunks, got {layout}")
    if tuple(dst.shape) != (e, np_, kp // 2) or tuple(dst_scales.shape) != (e, np_, kp // 16):
        raise ValueError(
            f"dst {tuple(dst.shape)} / {tuple(dst_scales.shape)} must be [{np_}, {kp // 2}] / "
            f"[{np_}, {kp // 16}] for a [{n}, {k}] matrix"
        )
    if not all(t[0].is_contiguous() for t in (dst, dst_scales)) or packed.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("each matrix of dst and dst_scales must be contiguous, and the inputs' rows too")
    bits, e5m3 = _tables(packed.device)
    _pack_fragments_kernel[((np_ // 64) * (kp // 128), e)](
        packed,
        scales.view(torch.uint8),
        dst.view(torch.int32),
        dst_scales,
        bits,
        e5m3,
        n,
        k,
        packed.stride(1),
        scales.stride(1),
        kp // 128,
        packed.stride(0),
        scales.stride(0),
        dst.stride(0) // 4,
        dst_scales.stride(0),
        num_warps=4,
    )


@functools.cache
def agrees_with_twin(device: torch.device, layout: FragmentLayout = FragmentLayout()) -> bool:
    """Whether the kernel on ``device`` gives the torch twin's bytes for a known matrix: every code byte, every
    scale byte from 0 (a zero block) to 0x7E and -0.0, rows and K padded (80 x 288 -> 128 x 384).  Once per device
    and process, before any checkpoint memory is overwritten: a compiler or driver that builds the kernel wrong
    must not turn into silently wrong weights (block_packer then falls back to the twin)."""
    n, k = 80, 288
    packed = (torch.arange(n * k // 2) * 37 % 256).to(torch.uint8).reshape(n, k // 2)
    scale = (torch.arange(n * k // 16) % 0x7F).to(torch.uint8)
    scale[::29] = 0x80
    scale = scale.reshape(n, k // 16).view(NVFP4.scale_dtype)
    want = layout.pack(packed, scale)
    got = tuple(torch.empty(t.shape, dtype=torch.uint8, device=device) for t in want)
    pack_fragment_block(packed.to(device), scale.to(device), *got, layout=layout)
    return all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def block_packer(device: torch.device, layout: FragmentLayout):
    """The ``pack_block`` entry: this packing kernel for ``layout`` on a GPU; None (``Sm90Layout.pack`` then runs its
    torch twin) on the CPU and on a GPU where the kernel fails its known-answer check (slower loading with more
    memory, the same weights)."""
    if device.type != "cuda":
        return None
    if not agrees_with_twin(device, layout):
        warnings.warn(
            f"moe_nvfp4: the packing kernel gives other bytes than its torch twin on {device} (Triton "
            f"{triton.__version__}); packing with the twin instead. Please report this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return functools.partial(pack_fragment_block, layout=layout)
