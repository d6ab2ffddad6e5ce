"""Memory layouts: FP4 codes two per byte (``pack_fp4``), and the scale layouts: the 128x4 blocked layout of
cuBLASLt, CUTLASS and FlashInfer.

For row i and scale column j of an [N, SFK] scale matrix the byte sits at
``((i // 128) * ceil(SFK / 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4``,
with rows padded to 128 and columns to 4 (per expert when batched).  Padding bytes are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FragmentLayout",
    "FRAGMENT_WORD_BITS",
    "GATE_UP_BLOCK",
    "encode_scale_e5m3",
    "decode_scale_e5m3",
    "padded_scale_shape",
    "swizzle_scales_128x4",
    "unswizzle_scales_128x4",
    "swizzled_offset",
    "pack_fp4",
    "unpack_fp4",
    "round_up",
    "rows_16_aligned",
]


# The sm_100a layout interleaves w13 in blocks of this many gate rows, then as many up rows: one 128 x 32 epilogue
# subtile of the CuTe DSL MoE holds a gate block and its up block.  Here, below both the weights object that packs
# it and the kernels that read it.
GATE_UP_BLOCK = 32


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, even K index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dimension must be even, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (x >= 1): triton.next_power_of_2 on the host, where Triton 3.6's is a
    constexpr function that costs microseconds a call in every forward."""
    return 1 << (x - 1).bit_length()


def rows_16_aligned(x: torch.Tensor) -> bool:
    """Whether 2-D activations ``x`` have the row layout the sm_90 Gluon GEMMs read: data on a 16-byte boundary and a
    row stride of a multiple of 16 elements (what Triton's JIT marks divisible; their cp.async copies 16 bytes)."""
    return x.data_ptr() % 16 == 0 and x.stride(0) % 16 == 0


def padded_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    return round_up(rows, 128), round_up(scale_cols, 4)


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


# Bit positions, inside one 32-bit word, of the four code bits (m, e0, e1, sign) of each of the word's eight
# values.  Values 0-1, 2-3, 4-5, 6-7 decode to one bf16x2 register each: value 2j into bits (6, 7, 8, 15) and
# value 2j+1 into (22, 23, 24, 31), i.e. exponent LSBs and first mantissa bit, so a code c becomes the bf16
# of c * 2^-126.  The positions make each register cheap to extract (sm90 kernel, _DECODE_WORD):
#   values 0-1: w & P;  2-3: (w << 3) & P;  4-5: ((w & 0x40074007) * 66) & P;
#   6-7: (((w >> 3) & 0x05C005C0) * 33) & P  with P = 0x81C081C0 (the multiplies add disjoint shifted copies).
FRAGMENT_WORD_BITS: tuple[tuple[int, int, int, int], ...] = (
    (6, 7, 8, 15),
    (22, 23, 24, 31),
    (3, 4, 5, 12),
    (19, 20, 21, 28),
    (0, 1, 2, 14),
    (16, 17, 18, 30),
    (9, 10, 11, 13),
    (25, 26, 27, 29),
)


def encode_scale_e5m3(scales: torch.Tensor) -> torch.Tensor:
    """Non-negative e4m3 block scales -> the kernel's byte: 0 for zero, else ((e + 10) << 3) | m for
    s = 2^e * (1 + m/8), e in [-9, 8] (e4m3 subnormals normalised).  Exact; decodes with one shift and
    one add to bf16 (bits (b << 4) + 0x7000 = s * 2^107) or fp16 (bits (b << 7) + 0x1400 = s)."""
    s = scales.float()
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    e = exp - 1
    m = torch.round((mant * 2 - 1) * 8).to(torch.int32)
    byte = ((e + 10) << 3) | m
    return torch.where(s > 0, byte, torch.zeros_like(byte)).to(torch.uint8)


def decode_scale_e5m3(byte: torch.Tensor) -> torch.Tensor:
    """Inverse of ``encode_scale_e5m3`` -> float32 (byte 0 -> 0)."""
    b = byte.to(torch.int32)
    value = torch.ldexp(1 + (b & 7).float() / 8, (b >> 3) - 10)
    return torch.where(b == 0, torch.zeros_like(value), value)


# Row-major codes [NP, KP] seen as [unit, warp, rh, r, chunk, g, kh, q, kp] (row = 64 unit + 16 warp + 8 rh + r,
# k = 128 chunk + 16 g + 8 kh + 2 q + kp), and the order FragmentLayout stores them in:
# [unit, chunk, slot = (warp, r, q), word g, value = (rh, kh, kp)].
def _value_dims(units: int, chunks: int) -> tuple[int, ...]:
    return (units, 4, 2, 8, chunks, 8, 2, 4, 2)


_VALUE_ORDER = (0, 4, 1, 3, 7, 5, 2, 6, 8)


# Scales [NP, KP/16] seen as [unit, warp, rh, r, chunk, g]; stored as [unit, chunk, (warp, r), g, rh].
def _scale_dims(units: int, chunks: int) -> tuple[int, ...]:
    return (units, 4, 2, 8, chunks, 8)


_SCALE_ORDER = (0, 4, 1, 3, 5, 2)


def _unpermute(stored: torch.Tensor, dims: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``x.view(dims).permute(order)``: the stored tensor back in ``dims`` order."""
    inverse = tuple(order.index(d) for d in range(len(order)))
    return stored.reshape(tuple(dims[d] for d in order)).permute(inverse)


@dataclass(frozen=True)
class FragmentLayout:
    """Weight layout of the sm_90 Triton MoE kernel: each thread's wgmma A fragment is one contiguous run.

    Rows are zero-padded to a multiple of 64 (a *unit*: one warp group's 64-row wgmma tile), K to a
    multiple of 128 (a *chunk*).  Unit u, chunk c occupies 4096 value bytes at (u * chunks + c) * 4096:
    128 slots of 32 bytes; slot t = 32 * warp + 4 * r + q holds rows R = 16 * warp + r and R + 8 at
    K = 16 g + 2 q + {0, 1} + {0, 8} for g = 0..7, one 32-bit word per g (bits: FRAGMENT_WORD_BITS;
    values in word order (R, +0), (R, +1), (R, +8), (R, +9), then the same for R + 8).  These are exactly
    the registers of the wgmma A operand, so a thread's fragment is two 16-byte loads and needs no shuffle.
    Scales: 512 bytes per unit and chunk at (u * chunks + c) * 512: 16 bytes per (warp, r) row pair,
    (g, R) and (g, R + 8) for g = 0..7, in ``encode_scale_e5m3`` form (shared by the four threads q).
    A block whose scale is zero has its codes zeroed (its values are zero either way).
    """

    unit_rows: int = 64
    chunk_k: int = 128
    version: int = 2

    def padded_k(self, k: int) -> int:
        return round_up(k, self.chunk_k)

    def padded_n(self, n: int) -> int:
        return round_up(n, self.unit_rows)

    @property
    def block_bytes(self) -> int:
        """Value bytes of one unit and chunk (two FP4 values a byte): 4096."""
        return self.unit_rows * self.chunk_k // 2

    @property
    def scale_block_bytes(self) -> int:
        """Scale bytes of one unit and chunk (one per 16 values): 512."""
        return self.unit_rows * self.chunk_k // 16

    def pack(self, packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One matrix: standard packing [N, K/2] + linear e4m3 scales [N, K/16] ->
        (values uint8 [NP, KP/2], scales uint8 [NP, KP/16]) in this layout."""
        n, k = packed.shape[0], packed.shape[1] * 2
        np_, kp = self.padded_n(n), self.padded_k(k)
        codes = torch.zeros(np_, kp, dtype=torch.uint8, device=packed.device)
        codes[:n, :k] = unpack_fp4(packed)
        s = torch.zeros(np_, kp // 16, dtype=torch.float32, device=packed.device)
        s[:n, : k // 16] = scales.float()
        codes = codes.view(np_, kp // 16, 16).masked_fill_((s == 0)[..., None], 0).view(np_, kp)
        units, chunks = np_ // self.unit_rows, kp // self.chunk_k
        v = (
            codes.view(_value_dims(units, chunks))
            .permute(_VALUE_ORDER)
            .reshape(units, chunks, 128, 8, 8)
            .to(torch.int64)
        )
        word = torch.zeros(v.shape[:-1], dtype=torch.int64, device=packed.device)
        for j, positions in enumerate(FRAGMENT_WORD_BITS):
            for bit, pos in enumerate(positions):
                word |= ((v[..., j] >> bit) & 1) << pos
        values = torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)
        sb = encode_scale_e5m3(s).view(_scale_dims(units, chunks)).permute(_SCALE_ORDER)
        return values.reshape(np_, kp // 2), sb.reshape(np_, kp // 16)

    def unpack(self, values: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``pack`` (zero-scale blocks come back with zero codes): -> (packed [N, K/2] uint8,
        e4m3 scales [N, K/16])."""
        np_, kp = self.padded_n(n), self.padded_k(k)
        if tuple(values.shape) != (np_, kp // 2) or tuple(scales.shape) != (np_, kp // 16):
            raise ValueError(
                f"packed values {tuple(values.shape)} / scales {tuple(scales.shape)} do not hold an [{n}, {k}] matrix "
                f"(expected {(np_, kp // 2)} and {(np_, kp // 16)})"
            )
        units, chunks = np_ // self.unit_rows, kp // self.chunk_k
        b = values.view(units, chunks, 128, 8, 4).to(torch.int64)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        v = torch.zeros(*word.shape, 8, dtype=torch.int64, device=values.device)
        for j, positions in enumerate(FRAGMENT_WORD_BITS):
            for bit, pos in enumerate(positions):
                v[..., j] |= ((word >> pos) & 1) << bit
        codes = _unpermute(v, _value_dims(units, chunks), _VALUE_ORDER).reshape(np_, kp)
        sb = _unpermute(scales, _scale_dims(units, chunks), _SCALE_ORDER).reshape(np_, kp // 16)
        e4m3 = decode_scale_e5m3(sb[:n, : k // 16]).to(torch.float8_e4m3fn)
        return pack_fp4(codes[:n, :k].to(torch.uint8)), e4m3
