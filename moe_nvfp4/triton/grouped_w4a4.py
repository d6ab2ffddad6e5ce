"""W4A4 NVFP4 grouped GEMM for Hopper in Triton: per group g, out_g = alpha_g * A_g @ B_g^T.

A_g [M_g, K_g] and B_g [N_g, K_g] are packed e2m1 (K-major, even K in the low nibble) with e4m3 block
scales in the 128x4 swizzled layout.  Both operands are decoded in registers to fp16: e2m1 times an e4m3
scale has at most 6 significant bits and lies in [2^-10, 2688], so every decoded value is exact; the MMA
accumulates in fp32 and the epilogue multiplies by alpha_g * global_A * global_B.  On data whose products
and sums are exact in fp32 (power-of-two global scales and alpha) the result equals the reference bit for bit.

One persistent launch over every group's tiles: groups are found through the tile prefix sums
(``tile_starts``), their tensors through pointer arrays, as in CUTLASS's grouped GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .scale_layout import swizzled_offset

__all__ = ["GroupedW4A4Plan", "plan_grouped_w4a4", "launch_grouped_w4a4"]


@triton.jit
def _e2m1_values(packed, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """uint8 [ROWS, BYTES] -> float32 [ROWS, 2 BYTES] e2m1 values (even K index from the low nibble)."""
    b = packed.to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), [ROWS, 2 * BYTES])
    c = codes & 7
    # 0, .5, 1, 1.5 for c < 4; 2, 3, 4, 6 = (2 or 3) * (1 or 2) above
    mag = tl.where(c < 4, c.to(tl.float32) * 0.5, ((2 + (c & 1)) * (1 + ((c >> 1) & 1))).to(tl.float32))
    return tl.where((codes & 8) != 0, -mag, mag)


@triton.jit
def _e4m3_values(byte):
    """e4m3 bytes (int32, sign bit clear: block scales are positive) -> float32, built from the bits."""
    exp = (byte >> 3) & 15
    man = byte & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # bias 7 -> 127
    return tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9


@triton.jit
def _load_operand(ptr, scale_ptr, row0, rows_total, k0, k, scale_col_blocks, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows row0.. of one operand, K columns k0..k0+BLOCK_K, decoded and scaled: fp16 [ROWS, BLOCK_K] (exact)."""
    rows = row0 + tl.arange(0, ROWS)
    bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ok = (rows < rows_total)[:, None] & (bytes_ < k // 2)[None, :]
    packed = tl.load(ptr + rows.to(tl.int64)[:, None] * (k // 2) + bytes_[None, :], mask=ok, other=0)
    values = _e2m1_values(packed, ROWS, BLOCK_K // 2)
    j = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    i = rows[:, None]
    offset = swizzled_offset(i, j[None, :], scale_col_blocks)
    s_ok = (rows < rows_total)[:, None] & (j < k // 16)[None, :]
    scales = _e4m3_values(tl.load(scale_ptr + offset.to(tl.int64), mask=s_ok, other=0).to(tl.int32))
    scaled = tl.reshape(values, [ROWS, BLOCK_K // 16, 16]) * scales[:, :, None]
    return tl.reshape(scaled, [ROWS, BLOCK_K]).to(tl.float16)


@triton.jit
def _grouped_w4a4_kernel(
    a_ptrs,
    b_ptrs,
    sa_ptrs,
    sb_ptrs,
    out_ptrs,
    sizes_ptr,
    tile_starts_ptr,
    alpha_ptr,
    num_groups,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    total = tl.load(tile_starts_ptr + num_groups)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        g = 0
        for h in range(1, num_groups):  # groups are few (the benchmark has up to 8): a scan is enough
            g += (tl.load(tile_starts_ptr + h) <= tile).to(tl.int32)
        m = tl.load(sizes_ptr + 3 * g)
        n = tl.load(sizes_ptr + 3 * g + 1)
        k = tl.load(sizes_ptr + 3 * g + 2)
        local = tile - tl.load(tile_starts_ptr + g)
        tiles_n = tl.cdiv(n, BLOCK_N)
        row0 = (local // tiles_n) * BLOCK_M
        col0 = (local % tiles_n) * BLOCK_N
        a = tl.load(a_ptrs + g).to(tl.pointer_type(tl.uint8))
        b = tl.load(b_ptrs + g).to(tl.pointer_type(tl.uint8))
        sa = tl.load(sa_ptrs + g).to(tl.pointer_type(tl.uint8))
        sb = tl.load(sb_ptrs + g).to(tl.pointer_type(tl.uint8))
        scale_col_blocks = tl.cdiv(k // 16, 4)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            a_tile = _load_operand(a, sa, row0, m, k0, k, scale_col_blocks, BLOCK_M, BLOCK_K)
            b_tile = _load_operand(b, sb, col0, n, k0, k, scale_col_blocks, BLOCK_N, BLOCK_K)
            acc = tl.dot(a_tile, tl.trans(b_tile), acc)
        out = tl.load(out_ptrs + g).to(tl.pointer_type(OUT_DTYPE))
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        y = (acc * tl.load(alpha_ptr + g)).to(OUT_DTYPE)
        tl.store(out + rows.to(tl.int64)[:, None] * n + cols[None, :], y, mask=(rows < m)[:, None] & (cols < n)[None, :])


_TL_OUT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class GroupedW4A4Plan:
    """Everything one launch needs, built once on the host: outputs, pointer arrays, sizes, tile prefix sums.
    ``launch_grouped_w4a4(plan)`` then only launches the kernel, so it can be captured in a CUDA graph and
    replayed after writing new values into the same input tensors."""

    outs: list[torch.Tensor]
    inputs: tuple[list[torch.Tensor], ...]  # held so the memory the pointers name stays alive
    pointers: tuple[torch.Tensor, ...]  # int64 [G] each: A, B, A scales, B scales, outputs
    sizes: torch.Tensor  # int32 [G, 3]: M, N, K
    tile_starts: torch.Tensor  # int32 [G + 1]
    alpha: torch.Tensor  # float32 [G]
    total_tiles: int
    grid: int
    out_dtype: torch.dtype
    block_m: int
    block_n: int
    block_k: int


def plan_grouped_w4a4(
    a_packed: list[torch.Tensor],
    a_scales: list[torch.Tensor],
    b_packed: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 128,
) -> GroupedW4A4Plan:
    """Inputs checked by api.plan_grouped_gemm_nvfp4: packed [M_g, K_g/2] / [N_g, K_g/2] uint8, swizzled e4m3
    scales, alpha float32 [G] (already times both global scales); outputs out_dtype [M_g, N_g]."""
    device = a_packed[0].device
    sizes = [(a.shape[0], b.shape[0], a.shape[1] * 2) for a, b in zip(a_packed, b_packed)]
    outs = [torch.empty(m, n, dtype=out_dtype, device=device) for m, n, _ in sizes]
    tile_starts = [0]
    for m, n, _ in sizes:
        tile_starts.append(tile_starts[-1] + triton.cdiv(m, block_m) * triton.cdiv(n, block_n))

    def pointer_array(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)

    scales_a = [s.view(torch.uint8) for s in a_scales]
    scales_b = [s.view(torch.uint8) for s in b_scales]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return GroupedW4A4Plan(
        outs=outs,
        inputs=(a_packed, a_scales, b_packed, b_scales),
        pointers=tuple(pointer_array(ts) for ts in (a_packed, b_packed, scales_a, scales_b, outs)),
        sizes=torch.tensor(sizes, dtype=torch.int32, device=device).reshape(-1, 3),
        tile_starts=torch.tensor(tile_starts, dtype=torch.int32, device=device),
        alpha=alpha,
        total_tiles=tile_starts[-1],
        grid=min(tile_starts[-1], 2 * sms),
        out_dtype=out_dtype,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
    )


def launch_grouped_w4a4(plan: GroupedW4A4Plan) -> list[torch.Tensor]:
    """One persistent launch (nothing else: no allocation, no host-to-device copy); returns plan.outs."""
    if plan.total_tiles:
        _grouped_w4a4_kernel[(plan.grid,)](
            *plan.pointers, plan.sizes, plan.tile_starts, plan.alpha, plan.sizes.shape[0],
            OUT_DTYPE=_TL_OUT[plan.out_dtype], BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            num_warps=4,
        )  # fmt: skip
    return plan.outs
