"""The W4A8 mode's grouped GEMM (issue 58, design 008): e4m3 token rows times the folded e4m3 expert weights
(weights.Fp8ExpertWeights) on FP8 wgmma, one persistent launch per GEMM over all experts, on the routing kernels'
tile map.

Both operands arrive through TMA descriptors: the weights are one [E N, K] matrix, and the token rows are in
sorted-row order for both GEMMs (GEMM1's were gathered while they were quantized, w4a8.quantize_rows_fp8), so a K
step is two box loads and one MMA, with no address tensors in registers.  A tile's box may run into the next
expert's rows or past the end: those columns are never stored (TMA fills past the end with zeros).  GEMM1's gated
weights hold each 64 gate rows beside their 64 up rows (weight_layouts.FP8_GATE_UP_BLOCK), so one 128-row MMA makes
both and one accumulator holds them.  The orientation is gemm_triton's (out^T = W @ A^T): weight rows are the
MMA's M side.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton import common as triton_common
from ..triton.common import _after_previous_kernel
from ..triton.launcher import launch
from .common import Epilogue, GemmRouting, _activation, _grouped_tile

__all__ = ["Fp8GemmOperands", "Fp8Tiles", "launch_fp8_gemm"]


class Fp8GemmOperands(NamedTuple):
    """One FP8 GEMM's inputs.  rows: float8_e4m3fn [R, K] token rows in sorted-row order and row_scale float32 [R]
    (value = e4m3 x scale); weight: float8_e4m3fn [E, N rows, K] and weight_scale float32 [E, N rows] (value =
    e4m3 x scale, global scale in); n_out: outputs per expert (GEMM1: I, its gated weights 2 pad64(I) rows)."""

    rows: torch.Tensor
    row_scale: torch.Tensor
    weight: torch.Tensor
    weight_scale: torch.Tensor
    n_out: int


class Fp8Tiles(NamedTuple):
    """The FP8 GEMMs' tiles (validated by w4a8.Fp8Config): block_m token rows, block_k K a step, num_stages loads
    in flight; both kernels take 128 weight rows a tile (GEMM1's: 64 gate + 64 up)."""

    block_m: int
    block_k: int
    num_stages: int


WEIGHT_ROWS = 128  # a tile's weight rows in both FP8 kernels (gemm_fp8_ws's two MMA warp groups share them)


@triton.jit
def _epilogue_rows(h, n0, expert, n_out, epilogue, BLOCK_N: tl.constexpr, IS_GEMM1: tl.constexpr, USE_ASM):
    """The scaled sums h [BLOCK_N weight rows, tokens] -> GEMM1's activation rows [outputs, tokens] (bias added),
    and their output offsets; GEMM2's rows pass through (bias added)."""
    GATE_UP: tl.constexpr = epilogue[4]
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATE_UP else BLOCK_N
    offs = n0 + tl.arange(0, OUT_N)
    bias_ptr = epilogue[0]
    if bias_ptr is not None:  # one [E, (2 if GATE_UP) n_out] float32 row per expert (gate, then up)
        bias_row = bias_ptr + expert.to(tl.int64) * (2 * n_out if GATE_UP else n_out) + offs
    if GATE_UP:  # rows 0..63 gate, 64..127 up: split into two [64, tokens] halves
        gate, up = tl.split(tl.permute(tl.reshape(h, [2, OUT_N, h.shape[1]]), (1, 2, 0)))
        if bias_ptr is not None:
            gate += tl.load(bias_row, mask=offs < n_out, other=0.0)[:, None]
            up += tl.load(bias_row + n_out, mask=offs < n_out, other=0.0)[:, None]
        y = _activation(gate, up, epilogue, USE_ASM)
    else:
        y = h
        if bias_ptr is not None:
            y += tl.load(bias_row, mask=offs < n_out, other=0.0)[:, None]
        if IS_GEMM1:  # a non-gated activation
            y = _activation(y, y, epilogue, USE_ASM)
    return y, offs


@triton.jit
def _fp8_tile(
    args,
    tile,
    epilogue,
    IS_GEMM1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """One tile: whole K, then the epilogue (common.Epilogue's variants, as gemm_triton's)."""
    GATE_UP: tl.constexpr = epilogue[4]
    # sm_90's FP8 MMA sums in less than fp32 precision (about 14 bits): Triton adds the MMA's sums into the fp32
    # accumulator every PRECISE_EVERY K (DeepGEMM's 128); without it 1.2-1.4e-2 of error against the twin on an H200
    PRECISE_EVERY: tl.constexpr = min(BLOCK_K, 128)
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, stride_out, pairs_ptr, n_out, n_rows, k = args
    n_tile, expert, row0, row_end = tile
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    w_row0 = expert * n_rows + n_tile * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([w_row0, k0])
        a = a_desc.load([row0, k0])
        acc = tl.dot(w, a.T, acc, max_num_imprecise_acc=PRECISE_EVERY)

    w_rows = w_row0 + tl.arange(0, BLOCK_N)
    w_scale = tl.load(w_scale_ptr + w_rows, mask=w_rows < (expert + 1) * n_rows, other=0.0)
    h = acc * w_scale[:, None] * tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    n0 = n_tile * (BLOCK_N // 2 if GATE_UP else BLOCK_N)
    y, offs = _epilogue_rows(h, n0, expert, n_out, epilogue, BLOCK_N, IS_GEMM1, USE_ASM)
    store_mask = (offs < n_out)[:, None] & row_ok[None, :]
    if IS_GEMM1:  # the activation row of each sorted row
        out_rows = rows
    else:  # each pair's row (the combine weights it)
        out_rows = tl.load(pairs_ptr + rows, mask=row_ok, other=0)
    out_ptrs = out_ptr + out_rows.to(tl.int64)[None, :] * stride_out + offs[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _fp8_gemm_kernel(
    a_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    stride_out,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_row_end_ptr,
    num_tiles_ptr,
    n_out,
    n_rows,
    k,
    epilogue,
    IS_GEMM1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Persistent grouped FP8 GEMM: out^T[n, m] = w_scale[n] a_scale[m] sum_k W_e[n, k] A[m, k] over the sorted
    rows m of each token tile, tiles dealt out to the programs in turn, whole K each.  GEMM1 (IS_GEMM1) writes
    act(gate, up) to the sorted row; GEMM2 writes the row to its pair.  n_rows: weight rows an expert."""
    _after_previous_kernel(PDL)
    num_m_tiles = tl.load(num_tiles_ptr)
    num_n_tiles = tl.cdiv(n_rows, BLOCK_N)
    args = (a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, stride_out)
    args += (sorted_pairs_ptr, n_out, n_rows, k)
    # one loop over every (tile, K step), so the loads run ahead across tiles: each tile's ring started cold
    # otherwise (6-16 K steps a tile at the zoo's prefill shapes; 1.2-1.5x slower, design 008 decision 7)
    for mn in tl.range(tl.program_id(0), num_m_tiles * num_n_tiles, tl.num_programs(0), flatten=True):
        m_tile, n_tile = _grouped_tile(mn, num_m_tiles, num_n_tiles)
        expert = tl.load(tile_expert_ptr + m_tile)
        tile = (n_tile, expert, tl.load(tile_row_ptr + m_tile), tl.load(tile_row_end_ptr + m_tile))
        _fp8_tile(args, tile, epilogue, IS_GEMM1, BLOCK_N, BLOCK_M, BLOCK_K, NUM_STAGES, USE_ASM)


def launch_fp8_gemm(
    operands: Fp8GemmOperands,
    out: torch.Tensor,
    routing: GemmRouting,
    tiles: Fp8Tiles,
    epilogue: Epilogue,
    *,
    is_gemm1: bool,
    sms: int,
) -> None:
    """One launch of _fp8_gemm_kernel over ``routing``'s tile map (built for ``tiles.block_m`` rows a tile): GEMM1
    when ``is_gemm1``, out[row] = act(rows[row] @ W^T); otherwise out[pair] = rows[row] @ W^T (unweighted).
    out [R, n_out]."""
    rows, row_scale, weight, weight_scale, n_out = operands
    e, n_rows, k = weight.shape
    a_desc = TensorDescriptor.from_tensor(rows, [tiles.block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(weight.view(e * n_rows, k), [WEIGHT_ROWS, tiles.block_k])
    launch(
        _fp8_gemm_kernel,
        (sms,),
        a_desc,
        row_scale,
        w_desc,
        weight_scale,
        out,
        out.stride(0),
        *routing.tile_map,
        n_out,
        n_rows,
        k,
        epilogue,
        IS_GEMM1=is_gemm1,
        BLOCK_N=WEIGHT_ROWS,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        NUM_STAGES=tiles.num_stages,
        USE_ASM=rows.is_cuda,  # the interpreter has no PTX
        num_warps=8 if tiles.block_m >= 128 else 4,  # 128 x 128 fp32 sums and their promoted twin: two warp groups
        **triton_common._dependent_launch(rows.device),
    )
