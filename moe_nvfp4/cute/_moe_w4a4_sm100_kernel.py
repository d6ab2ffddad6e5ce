"""Device code of the MoE form (see moe_w4a4_sm100.py): the list-form kernel with the two MoE epilogues.

Imported only when a kernel is built: this module imports cutlass at the top.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from ._grouped_w4a4_sm100_kernel import _ACC, GroupedW4A4Sm100
from ._w4a4_sm100_tensors import epilogue_view, load_accumulators, store_masked
from .tiles import GATE_UP_BLOCK, TILE_M

_LOG2E = math.log2(math.e)


class MoeGateUpSm100(GroupedW4A4Sm100):
    """GEMM1: SiLU(gate) * up from the interleaved gate/up accumulator column blocks."""

    def _setup(self) -> None:
        super()._setup()
        if cute.size(self.epi_tile[1]) != GATE_UP_BLOCK:
            raise ValueError(
                f"the gate/up interleave needs {GATE_UP_BLOCK}-column epilogue subtiles, got {self.epi_tile}"
            )

    @cute.jit
    def store_tile(
        self,
        tiled_t2r: cute.TiledCopy,
        thr_t2r: cute.TiledCopy,
        tTR_tAcc: cute.Tensor,
        epi_tile: cute.Tile,
        pointers: cute.Tensor,
        alpha: cute.Tensor,
        group: cutlass.Int32,
        m: cutlass.Int32,
        n: cutlass.Int32,
        tile_m: cutlass.Int32,
        tile_n: cutlass.Int32,
        k_tiles: cutlass.Int32,
    ):
        """Accumulator subtiles 2q and 2q + 1 are the gate and up rows of output subtile q: writes
        SiLU(alpha_gate * gate) * (alpha_up * up) to out_e[m, n / 2], ragged edges masked."""
        n_out = n // 2
        out_ptr = cute.make_ptr(self.out_dtype, pointers[group, 4], cute.AddressSpace.gmem, assumed_align=2)
        tile_mn, coord = (TILE_M, self.tile_n // 2), (tile_m, tile_n)
        out = cute.make_tensor(out_ptr, cute.make_layout((m, n_out), stride=(n_out, 1)))
        tTR_gC = epilogue_view(thr_t2r, epi_tile, out, tile_mn, coord)
        tTR_cC = epilogue_view(thr_t2r, epi_tile, cute.make_identity_tensor((m, n_out)), tile_mn, coord)
        gate_scale, up_scale = alpha[group, 0], alpha[group, 1]
        gate = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0)].shape, _ACC)
        up = cute.make_rmem_tensor(gate.shape, _ACC)
        result = cute.make_rmem_tensor(gate.shape, self.out_dtype)
        for sub_m in cutlass.range_constexpr(cute.size(tTR_gC, mode=[3])):
            for q in cutlass.range_constexpr(cute.size(tTR_gC, mode=[4])):
                load_accumulators(tiled_t2r, tTR_tAcc[(None, None, None, sub_m, 2 * q)], gate, k_tiles)
                load_accumulators(tiled_t2r, tTR_tAcc[(None, None, None, sub_m, 2 * q + 1)], up, k_tiles)
                g = gate.load() * gate_scale
                # SiLU(g) = g / (1 + e^-g), with e^-g = 2^(-g log2 e): ex2.approx and rcp.approx
                sigmoid = cute.math.rcp(cute.math.exp2(g * -_LOG2E, fastmath=True) + 1.0, approx=True, ftz=True)
                result.store((g * sigmoid * (up.load() * up_scale)).to(self.out_dtype))
                where = (None, None, None, sub_m, q)
                store_masked(result, tTR_gC[where], tTR_cC[where], (m, n_out))


class MoeDownSm100(GroupedW4A4Sm100):
    """GEMM2: rows scaled by their top-k weight and written to their (token, k) pair's row."""

    @cute.jit
    def store_tile(
        self,
        tiled_t2r: cute.TiledCopy,
        thr_t2r: cute.TiledCopy,
        tTR_tAcc: cute.Tensor,
        epi_tile: cute.Tile,
        pointers: cute.Tensor,
        alpha: cute.Tensor,
        group: cutlass.Int32,
        m: cutlass.Int32,
        n: cutlass.Int32,
        tile_m: cutlass.Int32,
        tile_n: cutlass.Int32,
        k_tiles: cutlass.Int32,
    ):
        """Row r of expert e: out[row_pairs_e[r], :] = alpha_e * row_weights_e[r] * acc[r, :] (rows past the
        expert's pair count and columns past N masked).  With 32x32b TMEM loads each thread holds one
        accumulator row (its TMEM lane), so the pair and weight are loaded once per thread and subtile row."""
        gmem = cute.AddressSpace.gmem
        out_ptr = cute.make_ptr(self.out_dtype, pointers[group, 4], gmem, assumed_align=4)
        row_pairs = cute.make_tensor(
            cute.make_ptr(cutlass.Int32, pointers[group, 5], gmem, assumed_align=4), cute.make_layout(m)
        )
        row_weights = cute.make_tensor(
            cute.make_ptr(cutlass.Float32, pointers[group, 6], gmem, assumed_align=4), cute.make_layout(m)
        )
        tTR_cC = epilogue_view(
            thr_t2r, epi_tile, cute.make_identity_tensor((m, n)), (TILE_M, self.tile_n), (tile_m, tile_n)
        )
        values = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape, _ACC)
        result = cute.make_rmem_tensor(values.shape, self.out_dtype)
        for sub_m in cutlass.range_constexpr(cute.size(tTR_cC, mode=[3])):
            row = tTR_cC[(None, None, None, sub_m, 0)][0][0]
            in_rows = row < m
            pair = cutlass.Int32(0)
            scale = cutlass.Float32(0.0)
            if in_rows:
                pair = row_pairs[row]
                scale = alpha[group, 0] * row_weights[row]
            # 64-bit row offset: T * top_k * H passes 2^31 at large T (H = 7168, top-8: from ~37k tokens)
            pair_row = cute.make_tensor(out_ptr + cutlass.Int64(pair) * n, cute.make_layout(n))
            for sub_n in cutlass.range_constexpr(cute.size(tTR_cC, mode=[4])):
                load_accumulators(tiled_t2r, tTR_tAcc[(None, None, None, sub_m, sub_n)], values, k_tiles)
                result.store((values.load() * scale).to(self.out_dtype))
                coords = tTR_cC[(None, None, None, sub_m, sub_n)]
                if in_rows:
                    for i in cutlass.range_constexpr(cute.size(result)):
                        column = coords[i][1]
                        if column < n:
                            pair_row[column] = result[i]
