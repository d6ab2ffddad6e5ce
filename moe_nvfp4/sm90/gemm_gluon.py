"""Warp-specialized sm_90 MoE GEMM (Gluon): a loader warp group feeds a ring of shared-memory stages, the MMA
warps decode FP4 from shared memory into their wgmma A registers.

Same contract and sums as gemm_triton._moe_gemm_kernel (its decode PTX, tile order and activations are shared).  There
every thread computes its own cp.async addresses and waits for its own copies; here one loader thread issues, per
stage and matrix, one TMA box of values and one of scales (4 KiB and 512 bytes per 64-row unit and K chunk), and its
warp group cp.async for the (gathered) token rows, running ahead across tile boundaries (why boxes of 128-byte rows,
one per matrix: design 002, decision 14).  A stage may hold several K chunks (GemmConfig.chunks_per_stage), and the
MMA warps keep MMAs running while they decode the stage's next matrix.  Two MMA warp groups may share each tile
(GemmConfig.k_groups), taking its K steps in turn: more warps decode a tile where there are fewer tiles than program
slots, and one loader warp group serves both.

Three files: gemm_gluon_loader (the tile walk and the loader partition), gemm_gluon_mma (the MMA partitions and the
epilogue) and this one (the kernel, which allocates the ring and starts the partitions, and its launch).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton import common as triton_common
from ..triton.launcher import launch
from .common import Epilogue, GemmRouting, GemmWeights, fragment_views
from .configs import GemmConfig, MoEKernelConfig
from .gemm_gluon_loader import _loader
from .gemm_gluon_mma import _consumer

# TMA boxes are 4-d [chunks, units, rows, 128 bytes] (global views: _descriptors); the MMA warps read one chunk of
# them as a 2-d tile (gemm_gluon_mma)
_W_BOX = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=4)
_S_BOX = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
# registers of the loader's warp group (setmaxnreg sets them per warp group; its idle warps hold as many):
# pointers and indices, GemmConfig.loader_warps of its warps issuing the token rows' cp.async
LOADER_REGISTERS = 56


# the pair count changes with T, and topk_ids come from the caller at any alignment: not specialized on, so
# neither a new T nor a new topk_ids allocation compiles a new variant
@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["ids_ptr", "expert_map_ptr"])
def _moe_gemm_ws_kernel(
    a_ptr,
    stride_a,
    w_desc,
    s_desc,
    gs_ptr,
    out_ptr,
    stride_out,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_row_end_ptr,
    num_tiles_ptr,
    ids_ptr,
    num_pairs,
    expert_map_ptr,
    num_global,
    num_experts,
    n_out,
    k,
    kp,
    epilogue,
    TOP_K: gl.constexpr,
    IS_GEMM1: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DTYPE: gl.constexpr,
    PDL: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CHUNKS: gl.constexpr,
    K_GROUPS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    NARROW: gl.constexpr,
    LOADER_WARPS: gl.constexpr,
    PAIR_TILES: gl.constexpr,
    HAS_MAP: gl.constexpr,
):
    NW: gl.constexpr = gl.num_warps()
    UNITS: gl.constexpr = BLOCK_N // 64
    # weight matrices per expert: gate and up, or one (GEMM2; GEMM1 with a non-gated activation)
    HALVES: gl.constexpr = 2 if epilogue[4] else 1  # gate and up matrices (common.Epilogue.GATE_UP)
    a_smem = gl.allocate_shared_memory(
        DTYPE,
        [STAGES * CHUNKS, BLOCK_M, 128],
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
    )
    # one TMA box per stage and matrix (HALVES 2: gate, up): CHUNKS K chunks of BLOCK_N rows
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * HALVES, CHUNKS, UNITS, 32, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * HALVES, CHUNKS, UNITS, 4, 128], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the TMA's expect-arrive + one cp.async arrive per loader thread
        mbarrier.init(ready.index(i), count=32 * LOADER_WARPS + 1)
        mbarrier.init(empty.index(i), count=1)
    # K group 1 hands its sums of a tile to group 0 through one buffer (gate and up when HALVES 2)
    sums_smem = gl.allocate_shared_memory(
        gl.float32, [max(HALVES * (K_GROUPS - 1), 1), BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    sums_full = gl.allocate_shared_memory(gl.int64, [max(K_GROUPS - 1, 1), 1], mbarrier.MBarrierLayout())
    sums_free = gl.allocate_shared_memory(gl.int64, [max(K_GROUPS - 1, 1), 1], mbarrier.MBarrierLayout())
    for g in gl.static_range(K_GROUPS - 1):
        mbarrier.init(sums_full.index(g), count=1)
        mbarrier.init(sums_free.index(g), count=1)
    # partitions: MMA group 0 in the launch's warps, group 1 (K_GROUPS 2) and the loader in worker warps.
    # Constexprs are spelled out in each call: in a tuple assigned to a name, Triton turns them into run-time values.
    # the routing kernel's tile map, or with PAIR_TILES topk_ids (flat), their count and what routes them (the
    # expert map with HAS_MAP, the global and local expert counts); the other part goes unread
    tile_map = (
        sorted_pairs_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        tile_row_end_ptr,
        num_tiles_ptr,
        ids_ptr,
        num_pairs,
        expert_map_ptr,
        num_global,
        num_experts,
    )
    shared = (
        w_smem,
        s_smem,
        a_smem,
        ready,
        empty,
        sums_smem,
        sums_full,
        sums_free,
        gs_ptr,
        out_ptr,
        stride_out,
        tile_map,
        n_out,
        kp,
    )
    loader = (a_ptr, stride_a, w_desc, s_desc, tile_map, a_smem, w_smem, s_smem, ready, empty, n_out, k, kp)
    # each partition waits for the previous kernel itself (_after_previous_kernel), GEMM2's loader after it has
    # issued its first tile's weights
    gl.static_assert(K_GROUPS == 1 or K_GROUPS == 2, "GemmConfig.k_groups is 1 or 2")
    if K_GROUPS == 1:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        shared,
                        epilogue,
                        IS_GEMM1,
                        HALVES,
                        BLOCK_N,
                        BLOCK_M,
                        STAGES,
                        DTYPE,
                        NW,
                        CHUNKS,
                        0,
                        1,
                        NARROW,
                        PAIR_TILES,
                        HAS_MAP,
                        PDL,
                    ),
                ),
                (
                    _loader,
                    (
                        loader,
                        TOP_K,
                        IS_GEMM1,
                        HALVES,
                        BLOCK_N,
                        BLOCK_M,
                        STAGES,
                        CHUNKS,
                        K_GROUPS,
                        LOADER_WARPS,
                        PAIR_TILES,
                        HAS_MAP,
                        PDL,
                    ),
                ),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        shared,
                        epilogue,
                        IS_GEMM1,
                        HALVES,
                        BLOCK_N,
                        BLOCK_M,
                        STAGES,
                        DTYPE,
                        NW,
                        CHUNKS,
                        0,
                        2,
                        NARROW,
                        PAIR_TILES,
                        HAS_MAP,
                        PDL,
                    ),
                ),
                (
                    _consumer,
                    (
                        shared,
                        epilogue,
                        IS_GEMM1,
                        HALVES,
                        BLOCK_N,
                        BLOCK_M,
                        STAGES,
                        DTYPE,
                        NW,
                        CHUNKS,
                        1,
                        2,
                        NARROW,
                        PAIR_TILES,
                        HAS_MAP,
                        PDL,
                    ),
                ),
                (
                    _loader,
                    (
                        loader,
                        TOP_K,
                        IS_GEMM1,
                        HALVES,
                        BLOCK_N,
                        BLOCK_M,
                        STAGES,
                        CHUNKS,
                        K_GROUPS,
                        LOADER_WARPS,
                        PAIR_TILES,
                        HAS_MAP,
                        PDL,
                    ),
                ),
            ],
            [NW, LOADER_WARPS],
            [MMA_REGS, LOADER_REGS],
        )


def _descriptors(
    w_packed: torch.Tensor, w_scale: torch.Tensor, kp: int, units: int, chunks: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Boxes of ``units`` consecutive 64-row units by ``chunks`` K chunks, chunk-major, over common.fragment_views.
    The 128-byte swizzle keeps the MMA warps' 16-byte reads (thread t: bytes 32 t .. 32 t + 31) free of bank
    conflicts."""
    values, scales = fragment_views(w_packed, w_scale, kp)
    return tuple(
        TensorDescriptor(v.flat, v.shape, v.strides, [chunks, units, v.rows, 128], layout)
        for v, layout in ((values, _W_BOX), (scales, _S_BOX))
    )


def _mma_registers(gemm: GemmConfig) -> int:
    """Registers per thread of MMA group 1 (setmaxnreg): the program's (its cap times its warps, the loader's warp
    group included) less the loader's, shared equally; Triton gives group 0 what the others leave."""
    if gemm.k_groups == 1:
        return 0  # no such group
    mma_warps = gemm.num_warps * gemm.k_groups
    per_warp = (gemm.max_registers * (mma_warps + 4) - 4 * LOADER_REGISTERS) // mma_warps
    return min(256, per_warp // 8 * 8)


def launch_gemm_ws(
    a: torch.Tensor,
    weights: GemmWeights,
    out: torch.Tensor,
    routing: GemmRouting,
    config: MoEKernelConfig,
    epilogue: Epilogue,
    *,
    is_gemm1: bool,
    top_k: int,
    sms: int,
) -> None:
    """One warp-specialized GEMM launch, gemm_triton.launch_gemm's contract: GEMM1 when ``is_gemm1`` (config.gemm1's
    tiles), out[row] = act(a[pair // top_k] @ W^T) for the pair of each sorted row; otherwise GEMM2 (config.gemm2's),
    out[pair] = a[row] @ W^T (unweighted).  a [rows, K] and out [rows, N] in 16-byte aligned rows; ``sms``
    programs per GemmConfig.programs_per_sm.  With ``routing.pair_tiles`` the tile map goes unread and no routing
    kernel needs to run.  A pair routed nowhere (routing.routed_pairs) is skipped: its output row is not written."""
    gemm = config.gemm1 if is_gemm1 else config.gemm2
    kp = weights.packed.shape[-1] * 2
    w_desc, s_desc = _descriptors(weights.packed, weights.scale, kp, gemm.block_n // 64, gemm.chunks_per_stage)
    num_experts = weights.packed.shape[0]
    ids, expert_map = routing.topk_ids, routing.expert_map
    has_map = routing.pair_tiles and expert_map is not None  # routed tiles hold local experts already
    pdl = triton_common._dependent_launch(a.device)["PDL"]
    launch(
        _moe_gemm_ws_kernel,
        (sms * gemm.programs_per_sm,),
        a,
        a.stride(0),
        w_desc,
        s_desc,
        weights.global_scale,
        out,
        out.stride(0),
        *routing.tile_map,
        ids,
        ids.numel(),
        expert_map if has_map else ids,
        expert_map.numel() if has_map else num_experts,
        num_experts,
        out.shape[1],
        a.shape[1],
        kp,
        epilogue,
        TOP_K=top_k,
        IS_GEMM1=is_gemm1,
        BLOCK_N=gemm.block_n,
        BLOCK_M=config.block_m,
        STAGES=gemm.num_stages,
        DTYPE=gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16,
        PDL=pdl,
        LOADER_REGS=LOADER_REGISTERS,
        CHUNKS=gemm.chunks_per_stage,
        K_GROUPS=gemm.k_groups,
        MMA_REGS=_mma_registers(gemm),
        NARROW=gemm.narrow_tiles,
        LOADER_WARPS=gemm.loader_warps,
        PAIR_TILES=routing.pair_tiles,
        HAS_MAP=has_map,
        launch_pdl=pdl,
        **gemm.launch_options(),
    )
