"""Tensor layouts, views and copies of the sm_100a W4A4 kernels (_grouped_w4a4_sm100_kernel and the fused MoE's
_moe_w4a4_sm100_kernel): the packed FP4 operands and their block-scale layout as CuTe sees them, the epilogue's
TMEM -> register -> global views, the scales' shared -> TMEM copy, and the walk from a tile to its group.

Imported only when a kernel is built: this module imports cutlass at the top.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import tcgen05

from .tiles import SF_VEC, TILE_M

_SF = cutlass.Float8E4M3FN  # the block scales' type


def _rows(pointer: cute.Pointer, count: cutlass.Int32, columns: int) -> cute.Tensor:
    """A row-major [count, columns] device array."""
    return cute.make_tensor(pointer, cute.make_layout((count, columns), stride=(columns, 1)))


def epilogue_view(
    thr_t2r: cute.TiledCopy, epi_tile: cute.Tile, tensor: cute.Tensor, tile_shape: tuple, coord: tuple
) -> cute.Tensor:
    """This thread's part of output tile ``coord`` of ``tensor``, cut in epilogue subtiles:
    (copy, rest, rest, subtile M, subtile N), matching the TMEM partition of the accumulator."""
    return thr_t2r.partition_D(cute.flat_divide(cute.local_tile(tensor, tile_shape, coord), epi_tile))


@cute.jit
def load_accumulators(tiled_t2r: cute.TiledCopy, tmem: cute.Tensor, values: cute.Tensor, k_tiles: cutlass.Int32):
    """One epilogue subtile TMEM -> registers (``tcgen05.ld``, warp-collective: never under a per-thread
    condition); K = 0 leaves nothing in TMEM and the product is zero."""
    if k_tiles > 0:
        cute.copy(tiled_t2r, tmem, values)
    else:
        values.fill(0.0)


@cute.jit
def store_masked(values: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor, bound: tuple):
    """dst[i] = values[i] where coords[i] lies inside ``bound`` (the ragged edges of an output)."""
    for i in cutlass.range_constexpr(cute.size(values)):
        if cute.elem_less(coords[i], bound):
            dst[i] = values[i]


def operand_layout(rows: cutlass.Int32 | int, k: cutlass.Int32 | int) -> cute.Layout:
    """A packed FP4 operand as (rows, K, 1) in FP4 elements, K-major: element (r, k) is nibble r * K + k,
    i.e. byte (r * K + k) // 2, even k in the low nibble.  K % 32 == 0 keeps rows 16-byte aligned for TMA."""
    k_aligned = cute.assume(k, 32) if isinstance(k, cutlass.Int32) else k
    return cute.make_layout((rows, k_aligned, 1), stride=(k_aligned, 1, rows * k_aligned))


def scale_layout(operand_shape: tuple) -> cute.Layout:
    """The e4m3 scales of an operand of shape (rows, K, 1): CuTe's block-scaled atom ((32, 4), (16, 4)) tiled
    K-first over the operand, which is the 128x4 blocked layout of ``layouts.swizzled_offset`` (tested)."""
    return blockscaled_utils.tile_atom_to_shape_SF(operand_shape, SF_VEC)


def _scales_to_tmem(smem: cute.Tensor, tmem: cute.Tensor) -> tuple:
    """The ``tcgen05.cp`` (4x32dp128bit) copy of one stage's scales from smem into their TMEM columns."""
    atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), _SF)
    tmem_compact = cute.filter_zeros(tmem)
    tiled = tcgen05.make_s2t_copy(atom, tmem_compact)
    thr = tiled.get_slice(0)
    src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(smem)))
    return tiled, src, thr.partition_D(tmem_compact)


@cute.jit
def tiles_of(tile_n: int, sizes: cute.Tensor, g: cutlass.Int32) -> cutlass.Int32:
    """Output tiles of group g (row-major over (M tiles, N tiles)), N tiles ``tile_n`` wide."""
    return cute.ceil_div(sizes[g, 0], TILE_M) * cute.ceil_div(sizes[g, 1], tile_n)


@cute.jit
def find_group(
    tile_n: int,
    sizes: cute.Tensor,
    num_groups: cutlass.Int32,
    tile: cutlass.Int32,
    group: cutlass.Int32,
    first: cutlass.Int32,
) -> tuple:
    """Move the cursor (group, first tile of group) forward until it holds ``tile``; group == num_groups
    once ``tile`` is past the last group.  Tiles only grow along a CTA's walk, so each role scans every
    group at most once per launch."""
    count = cutlass.Int32(0)
    if group < num_groups:
        count = tiles_of(tile_n, sizes, group)
    while group < num_groups and tile >= first + count:
        first = first + count
        group = group + 1
        count = cutlass.Int32(0)
        if group < num_groups:
            count = tiles_of(tile_n, sizes, group)
    return group, first
