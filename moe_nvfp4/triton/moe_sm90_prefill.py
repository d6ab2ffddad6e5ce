"""Prefill sm_90 MoE GEMM (Gluon): decode warps write bf16 weight tiles to shared memory, one MMA warp group runs
wgmma with both operands there.

Same contract, tiles order, decode and epilogue as moe_sm90_ws (whose helpers it reuses); what differs is who
decodes.  There the MMA warps decode their own wgmma A registers, so each MMA waits on its own decode chain: fine
while the weights' bytes bound the GEMM (decode), the limit once the tensor cores do (prefill, T >= 1024).  Here four
partitions run side by side:
  weight loader (1 warp)   TMA boxes of FP4 values and scales into the weight ring;
  token loader             cp.async of the tile's (gathered) token rows into the token ring;
  decoders (4 warps each)  weight ring -> the same decode PTX -> bf16 tiles in the decoded ring (wgmma's A layout),
                           one partition per 64-row block;
  MMA (4 warps)            wgmma from the decoded and token rings into two accumulators, then the epilogue.
A tile is two 64-row blocks of weights by BLOCK_M tokens: GEMM1's gate and up rows of 64 outputs (or, without up
rows, 128 outputs), GEMM2's 128 outputs; each block has its own accumulator, so the epilogue is moe_sm90_ws's.
Every tile takes whole K in one MMA group, in the kernels' grouped tile order: a row's sums never depend on where
its tile runs (design 002 decision 8).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..configs import MoEKernelConfig
from . import sm90_common
from .moe_sm90_ws import (_W_TILE, _S_TILE, _after_previous_kernel, _decode_tile, _descriptors, _epilogue,
                          _epilogue_operands, _pair_ids, _stage_weights, _tile)
from .sm90_common import Epilogue, GemmRouting, GemmWeights

# registers per thread of the worker partitions (setmaxnreg, per warp group); the MMA group gets the rest
DECODER_REGISTERS: gl.constexpr = gl.constexpr(96)
LOADER_REGISTERS: gl.constexpr = gl.constexpr(80)
WEIGHT_LOADER_REGISTERS: gl.constexpr = gl.constexpr(40)
# a tile's weight blocks of 64 rows, each with its own accumulator
BLOCKS: gl.constexpr = gl.constexpr(2)
# ring depths: decoded tiles (32 KiB a step) and FP4 weights (9 KiB a step); the token ring takes what is left
D_STAGES = 2
W_STAGES = 4
SMEM_LIMIT = 227 * 1024 - 1024


def token_stages(block_m: int) -> int:
    """Token ring stages that fit beside the other rings (block_m rows of 128 16-bit values a step), at most 4."""
    rest = SMEM_LIMIT - D_STAGES * BLOCKS.value * 64 * 128 * 2 - W_STAGES * BLOCKS.value * (4096 + 512)
    return min(4, rest // (block_m * 128 * 2))


@gluon.jit
def _shape(n_out, kp, HALVES: gl.constexpr):
    """The tile grid's weight side and the K steps: GEMM1 with up rows tiles its outputs by 64 (a gate and an up
    block), the others by 128 (two blocks of one matrix).  Returns (units per block's matrix step, N tiles, 64-row
    units per matrix, K steps)."""
    UNITS: gl.constexpr = BLOCKS // HALVES
    return gl.cdiv(n_out, 64 * UNITS), gl.cdiv(n_out, 64), kp // 128


@gluon.jit
def _weight_loader(args, HALVES: gl.constexpr, W_STAGES: gl.constexpr, PDL: gl.constexpr):
    """One thread issues each step's weight boxes (both blocks) into the weight ring."""
    (w_desc, s_desc, w_smem, s_smem, w_ready, w_empty, tile_map, n_out, kp) = args
    UNITS: gl.constexpr = BLOCKS // HALVES
    _after_previous_kernel(PDL)
    num_n_tiles, n_units, steps = _shape(n_out, kp, HALVES)
    num_m_tiles = gl.load(tile_map[4])
    it = 0
    for mn in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        n_tile, expert, row0, row_end = _tile(mn, num_m_tiles, num_n_tiles, tile_map, False, False)
        unit0 = expert * (HALVES * n_units) + n_tile * UNITS
        for step in range(steps):
            s = it % W_STAGES
            mbarrier.wait(w_empty.index(s), ((it // W_STAGES) & 1) ^ 1)
            _stage_weights(w_desc, s_desc, w_smem, s_smem, w_ready.index(s), s, step, unit0, n_units, True, HALVES,
                           UNITS, 1)
            it += 1


@gluon.jit
def _token_loader(args, TOP_K: gl.constexpr, GATED: gl.constexpr, HALVES: gl.constexpr, BLOCK_M: gl.constexpr,
                  A_STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, PDL: gl.constexpr):
    """The tile's token rows, 128 K a step, by cp.async into the token ring (GEMM1 gathers x's rows by pair //
    TOP_K; GEMM2 reads GEMM1's rows in sorted order)."""
    (a_ptr, stride_a, a_smem, a_ready, a_empty, tile_map, n_out, k, kp) = args
    A_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LOADER_WARPS, 1], [1, 0])
    _after_previous_kernel(PDL)
    num_n_tiles, n_units, steps = _shape(n_out, kp, HALVES)
    num_m_tiles = gl.load(tile_map[4])
    kk = gl.arange(0, 128, layout=gl.SliceLayout(0, A_L))
    it = 0
    for mn in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        n_tile, expert, row0, row_end = _tile(mn, num_m_tiles, num_n_tiles, tile_map, False, False)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_L))
        row_ok = rows < row_end
        if GATED:
            a_rows = _pair_ids(tile_map, rows, row_ok, False) // TOP_K
        else:
            a_rows = gl.where(row_ok, rows, row0)
        a_ptrs = a_ptr + a_rows.to(gl.int64)[:, None] * stride_a + kk[None, :]
        for step in range(steps):
            s = it % A_STAGES
            mbarrier.wait(a_empty.index(s), ((it // A_STAGES) & 1) ^ 1)
            k_ok = (step * 128 + kk) < k
            # rows past the tile's end are zero-filled: their sums are never stored, and zeros keep them finite
            async_copy.async_copy_global_to_shared(a_smem.index(s), a_ptrs + step * 128,
                                                   mask=row_ok[:, None] & k_ok[None, :])
            async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
            it += 1


@gluon.jit
def _decode_block(w_smem, s_smem, d_smem, ws, ds, B: gl.constexpr, HALVES: gl.constexpr, DTYPE: gl.constexpr,
                  DOT_L: gl.constexpr):
    """Weight block B of weight-ring stage ws into decoded-ring stage ds: matrix B's (gate, up) one unit, or unit
    B of the one matrix's box."""
    UNITS: gl.constexpr = BLOCKS // HALVES
    UNIT: gl.constexpr = B // HALVES
    box = ws * HALVES + B % HALVES
    w = w_smem.index(box)._reinterpret(gl.uint8, [UNITS, 32, 128], _W_TILE).index(UNIT)
    sc = s_smem.index(box)._reinterpret(gl.uint8, [UNITS, 4, 128], _S_TILE).index(UNIT)
    d_smem.index(ds * BLOCKS + B).store(_decode_tile(w, sc, 64, DTYPE, 4, DOT_L))


@gluon.jit
def _decoder(args, BLOCK: gl.constexpr, HALVES: gl.constexpr, BLOCK_M: gl.constexpr, W_STAGES: gl.constexpr,
             D_STAGES: gl.constexpr, DTYPE: gl.constexpr, PDL: gl.constexpr):
    """Weight block BLOCK of each step from FP4 in the weight ring to a DTYPE tile in the decoded ring, in the
    layout wgmma reads its A operand from (values exact, times a power of two the epilogue undoes).  One decoder
    partition per block: one warp group a scheduler decoding both blocks could not keep up with the MMAs."""
    (w_smem, s_smem, w_ready, w_empty, d_smem, d_ready, d_empty, tile_map, n_out, kp) = args
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    DOT_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_L, k_width=2)
    _after_previous_kernel(PDL)
    num_n_tiles, n_units, steps = _shape(n_out, kp, HALVES)
    num_m_tiles = gl.load(tile_map[4])
    it = 0
    for mn in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        for step in range(steps):
            ws = it % W_STAGES
            ds = it % D_STAGES
            mbarrier.wait(w_ready.index(ws), (it // W_STAGES) & 1)
            mbarrier.wait(d_empty.index(ds), ((it // D_STAGES) & 1) ^ 1)
            _decode_block(w_smem, s_smem, d_smem, ws, ds, BLOCK, HALVES, DTYPE, DOT_L)
            mbarrier.arrive(w_empty.index(ws))
            fence_async_shared()  # the tile was written by st.shared (generic proxy); wgmma reads it async
            mbarrier.arrive(d_ready.index(ds))
            it += 1


@gluon.jit
def _mma(args, epilogue, GATED: gl.constexpr, HALVES: gl.constexpr, BLOCK_M: gl.constexpr, A_STAGES: gl.constexpr,
         D_STAGES: gl.constexpr, DTYPE: gl.constexpr, PDL: gl.constexpr):
    """Each tile's K steps on the tensor cores (one step's MMAs left running while the next step's are issued),
    then moe_sm90_ws's epilogue per block."""
    (a_smem, a_ready, a_empty, d_smem, d_ready, d_empty, gs_ptr, out_ptr, stride_out, tile_map, topk_weights_ptr,
     n_out, kp) = args
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    _after_previous_kernel(PDL)
    num_n_tiles, n_units, steps = _shape(n_out, kp, HALVES)
    num_m_tiles = gl.load(tile_map[4])
    it = 0
    for mn in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        n_tile, expert, row0, row_end = _tile(mn, num_m_tiles, num_n_tiles, tile_map, False, False)
        operands = _epilogue_operands(expert, row0, row_end, gs_ptr, tile_map, GATED, HALVES, BLOCK_M, MMA_L, False)
        acc0 = gl.zeros([64, BLOCK_M], gl.float32, MMA_L)
        acc1 = gl.zeros([64, BLOCK_M], gl.float32, MMA_L)
        for step in range(steps):
            a_s = it % A_STAGES
            ds = it % D_STAGES
            mbarrier.wait(a_ready.index(a_s), (it // A_STAGES) & 1)
            mbarrier.wait(d_ready.index(ds), (it // D_STAGES) & 1)
            fence_async_shared()  # the token rows came by cp.async (generic proxy)
            b = a_smem.index(a_s).permute((1, 0))
            acc0 = warpgroup_mma(d_smem.index(ds * BLOCKS), b, acc0, is_async=True)
            acc1 = warpgroup_mma(d_smem.index(ds * BLOCKS + 1), b, acc1, is_async=True)
            # the previous step's two MMAs have read their stages: hand them back
            acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
            if step > 0:
                mbarrier.arrive(a_empty.index((it - 1) % A_STAGES))
                mbarrier.arrive(d_empty.index((it - 1) % D_STAGES))
            it += 1
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        mbarrier.arrive(a_empty.index((it - 1) % A_STAGES))
        mbarrier.arrive(d_empty.index((it - 1) % D_STAGES))
        if HALVES == 2:
            _epilogue(acc0, acc1, n_tile, expert, row0, row_end, operands, out_ptr, stride_out, topk_weights_ptr,
                      n_out, epilogue, GATED, 2, 64, BLOCK_M, DTYPE, MMA_L)
        else:
            _epilogue(acc0, acc0, 2 * n_tile, expert, row0, row_end, operands, out_ptr, stride_out, topk_weights_ptr,
                      n_out, epilogue, GATED, 1, 64, BLOCK_M, DTYPE, MMA_L)
            _epilogue(acc1, acc1, 2 * n_tile + 1, expert, row0, row_end, operands, out_ptr, stride_out,
                      topk_weights_ptr, n_out, epilogue, GATED, 1, 64, BLOCK_M, DTYPE, MMA_L)


@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["ids_ptr"])
def _moe_gemm_prefill_kernel(a_ptr, stride_a, w_desc, s_desc, gs_ptr, out_ptr, stride_out, sorted_pairs_ptr,
                             tile_expert_ptr, tile_row_ptr, tile_row_end_ptr, num_tiles_ptr, ids_ptr, num_pairs,
                             topk_weights_ptr, n_out, k, kp, epilogue, TOP_K: gl.constexpr, GATED: gl.constexpr,
                             BLOCK_M: gl.constexpr, A_STAGES: gl.constexpr, D_STAGES: gl.constexpr,
                             W_STAGES: gl.constexpr, DTYPE: gl.constexpr, PDL: gl.constexpr,
                             LOADER_WARPS: gl.constexpr):
    # weight matrices per expert: gate and up, or one (GEMM2; GEMM1 with a non-gated activation)
    HALVES: gl.constexpr = 2 if GATED and epilogue[1] != "relu2" else 1
    UNITS: gl.constexpr = BLOCKS // HALVES
    a_smem = gl.allocate_shared_memory(DTYPE, [A_STAGES, BLOCK_M, 128],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    d_smem = gl.allocate_shared_memory(DTYPE, [D_STAGES * BLOCKS, 64, 128],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    w_smem = gl.allocate_shared_memory(gl.uint8, [W_STAGES * HALVES, 1, UNITS, 32, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [W_STAGES * HALVES, 1, UNITS, 4, 128], s_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [D_STAGES, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [D_STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(A_STAGES):
        mbarrier.init(a_ready.index(i), count=32 * LOADER_WARPS)  # one cp.async arrive per loader thread
        mbarrier.init(a_empty.index(i), count=1)
    for i in gl.static_range(D_STAGES):
        mbarrier.init(d_ready.index(i), count=BLOCKS)  # each block's decoder
        mbarrier.init(d_empty.index(i), count=1)
    for i in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(i), count=1)  # the TMA's expect-arrive
        mbarrier.init(w_empty.index(i), count=BLOCKS)
    # the routing kernel's tile map (moe_sm90_ws._tile's tuple; pair tiles are the decode kernel's alone)
    tile_map = (sorted_pairs_ptr, tile_expert_ptr, tile_row_ptr, tile_row_end_ptr, num_tiles_ptr, ids_ptr, num_pairs,
                ids_ptr, 0, 0)
    mma = (a_smem, a_ready, a_empty, d_smem, d_ready, d_empty, gs_ptr, out_ptr, stride_out, tile_map,
           topk_weights_ptr, n_out, kp)
    decoder = (w_smem, s_smem, w_ready, w_empty, d_smem, d_ready, d_empty, tile_map, n_out, kp)
    weights = (w_desc, s_desc, w_smem, s_smem, w_ready, w_empty, tile_map, n_out, kp)
    tokens = (a_ptr, stride_a, a_smem, a_ready, a_empty, tile_map, n_out, k, kp)
    gl.warp_specialize([
        (_mma, (mma, epilogue, GATED, HALVES, BLOCK_M, A_STAGES, D_STAGES, DTYPE, PDL)),
        (_decoder, (decoder, 0, HALVES, BLOCK_M, W_STAGES, D_STAGES, DTYPE, PDL)),
        (_decoder, (decoder, 1, HALVES, BLOCK_M, W_STAGES, D_STAGES, DTYPE, PDL)),
        (_token_loader, (tokens, TOP_K, GATED, HALVES, BLOCK_M, A_STAGES, LOADER_WARPS, PDL)),
        (_weight_loader, (weights, HALVES, W_STAGES, PDL)),
    ], [4, 4, LOADER_WARPS, 1],
        [DECODER_REGISTERS, DECODER_REGISTERS, LOADER_REGISTERS, WEIGHT_LOADER_REGISTERS])  # fmt: skip


def launch_gemm_prefill(a: torch.Tensor, weights: GemmWeights, out: torch.Tensor, routing: GemmRouting,
                        config: MoEKernelConfig, epilogue: Epilogue, *, gated: bool, top_k: int, sms: int) -> None:
    """One prefill GEMM launch, moe_sm90.launch_gemm's contract (routed tiles of config.block_m tokens; the GEMM's
    tile is fixed: two 64-row weight blocks)."""
    gemm = config.gemm1 if gated else config.gemm2
    kp = weights.packed.shape[-1] * 2
    a_stages = min(gemm.num_stages, token_stages(config.block_m))
    halves = 2 if gated and epilogue.ACTIVATION != "relu2" else 1
    w_desc, s_desc = _descriptors(weights.packed, weights.scale, kp, BLOCKS.value // halves, 1)
    topk_weights = routing.topk_weights if gated else routing.topk_weights.reshape(-1)  # GEMM1 reads none
    ids = routing.topk_ids
    pdl = sm90_common._dependent_launch(a.device)["PDL"]
    _moe_gemm_prefill_kernel[(sms * gemm.programs_per_sm,)](
        a, a.stride(0), w_desc, s_desc, weights.global_scale, out, out.stride(0), *routing.tile_map, ids, ids.numel(),
        topk_weights, out.shape[1], a.shape[1], kp, epilogue,
        TOP_K=top_k, GATED=gated, BLOCK_M=config.block_m, A_STAGES=a_stages, D_STAGES=D_STAGES,
        W_STAGES=W_STAGES, DTYPE=gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16, PDL=pdl,
        LOADER_WARPS=gemm.loader_warps, launch_pdl=pdl, **gemm.launch_options(),
    )  # fmt: skip
