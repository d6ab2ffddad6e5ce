"""Warp-specialized sm_90 MoE GEMM (Gluon): a loader warp group feeds a ring of shared-memory stages, the MMA
warps decode FP4 from shared memory into their wgmma A registers.

Same contract and sums as gemm_triton._moe_gemm_kernel (its decode PTX, tile order and activations are shared).  There
every thread computes its own cp.async addresses and waits for its own copies (170 of the decode loop's 426 SASS
instructions per K step at block_n 64); here one loader thread issues, per stage and
matrix, one TMA box of values and one of scales (4 KiB and 512 bytes per 64-row unit and K chunk), and its
warp group cp.async for the (gathered) token rows, running ahead across tile boundaries.  What made it faster on the
H200 was the loads' rate: boxes of 128-byte rows stream at 3.6 TB/s where 32-byte rows reached 2.9, and one
box per matrix for all of a tile's units at 3.9-4.1 (design 002).  A stage may hold several K chunks
(GemmConfig.chunks_per_stage), and the MMA warps keep MMAs running while they decode the stage's next
matrix: the decode, not the loads, is what limits it now.  Two MMA warp groups may share each tile
(GemmConfig.k_groups), taking its K steps in turn: more warps decode a tile where there are fewer tiles than
program slots, and one loader warp group serves both.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..layouts import FragmentLayout
from ..triton import common as triton_common
from ..triton.common import _routed
from .common import (
    BF16_EPILOGUE_FIX,
    BLOCK_BYTES,
    FP16_EPILOGUE_FIX,
    SCALE_BLOCK_BYTES,
    Epilogue,
    GemmRouting,
    GemmWeights,
    _activation,
    _decode_words,
    _grouped_tile,
)
from .configs import GemmConfig, MoEKernelConfig

# TMA boxes are 4-d [chunks, units, rows, 128 bytes] (global views below); the MMA warps read one chunk of
# them as the 2-d [units x rows, 128] tile they were laid out as
_W_BOX = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=4)
_S_BOX = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
_W_TILE = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
_S_TILE = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
# registers of the loader's warp group (setmaxnreg sets them per warp group; its idle warps hold as many):
# pointers and indices, GemmConfig.loader_warps of its warps issuing the token rows' cp.async
LOADER_REGISTERS = 56


@gluon.jit
def _after_previous_kernel(PDL: gl.constexpr):
    """triton.common._after_previous_kernel in Gluon, run by every partition before it reads what the previous
    kernel writes: wait for its writes, then let the next kernel launch (programmatic dependent launch).  Each
    thread waits before it lets the next kernel launch, so a kernel that is running knows the kernel two back
    has ended: GEMM2's loader reads the routing kernel's tile map (with pair tiles, topk_ids, written before
    GEMM1) before its own wait."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _stage_weights(
    w_desc,
    s_desc,
    w_smem,
    s_smem,
    bar,
    s,
    step,
    unit0,
    n_units,
    pred,
    HALVES: gl.constexpr,
    UNITS: gl.constexpr,
    CHUNKS: gl.constexpr,
):
    """A stage's weight boxes (HALVES 2: gate and up, the up units n_units after the gate units), counted on its
    barrier by one expect-arrive."""
    mbarrier.expect(bar, HALVES * UNITS * CHUNKS * (BLOCK_BYTES + SCALE_BLOCK_BYTES), pred=pred)
    for h in gl.static_range(HALVES):
        unit = unit0 + h * n_units
        tma.async_copy_global_to_shared(
            w_desc, [step * CHUNKS, unit, 0, 0], bar, w_smem.index(s * HALVES + h), pred=pred
        )
        tma.async_copy_global_to_shared(
            s_desc, [step * CHUNKS, unit, 0, 0], bar, s_smem.index(s * HALVES + h), pred=pred
        )


@gluon.jit
def _token_tiles(tile_map, PAIR_TILES: gl.constexpr):
    """How many token tiles: the routing kernel's count, or with PAIR_TILES one per (token, k) pair (tile_map is
    the kernel's (sorted_pairs, tile_expert, tile_row, tile_row_end, num_tiles, topk_ids, num_pairs, expert_map,
    num_global, num_experts))."""
    if PAIR_TILES:
        return tile_map[6]
    else:
        return gl.load(tile_map[4])


@gluon.jit
def _tile(mn, num_m_tiles, num_n_tiles, tile_map, PAIR_TILES: gl.constexpr, HAS_MAP: gl.constexpr):
    """Tile mn (gemm_triton's grouped order): its n tile, expert, first sorted row and end of rows, three loads side
    by side.  With PAIR_TILES token tile m is pair m, one row (row m), its expert read from topk_ids (through the
    expert map with HAS_MAP); a pair routed nowhere (triton.common._routed: an id or map entry out of range, another
    rank's expert) has no row and expert 0, and loader and MMA warps skip it (_has_rows).  Loader and MMA warps
    walk the same tiles."""
    (
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
    ) = tile_map
    m_tile, n_tile = _grouped_tile(mn, num_m_tiles, num_n_tiles)
    if PAIR_TILES:
        expert, routed = _routed(
            gl.load(ids_ptr + m_tile).to(gl.int32), True, expert_map_ptr, num_global, num_experts, HAS_MAP
        )
        return n_tile, gl.where(routed, expert, 0), m_tile, m_tile + routed.to(gl.int32)
    else:
        return (
            n_tile,
            gl.load(tile_expert_ptr + m_tile),
            gl.load(tile_row_ptr + m_tile),
            gl.load(tile_row_end_ptr + m_tile),
        )


@gluon.jit
def _has_rows(row0, row_end, PAIR_TILES: gl.constexpr):
    """1 where tile (row0, row_end) has rows, else 0: every routed tile has, a pair tile of a pair routed nowhere
    (_tile) has none.  Loader and MMA warps skip such a tile alike (no stage, no barrier phase)."""
    if PAIR_TILES:
        return row_end - row0
    else:
        return 1


@gluon.jit
def _pair_ids(tile_map, rows, row_ok, PAIR_TILES: gl.constexpr):
    """The (token, k) pair of each sorted row: the routing kernel's, or with PAIR_TILES the row itself."""
    if PAIR_TILES:
        return gl.where(row_ok, rows, 0)
    else:
        return gl.load(tile_map[0] + rows, mask=row_ok, other=0)


@gluon.jit
def _tile_steps(kp, CHUNKS: gl.constexpr, K_GROUPS: gl.constexpr):
    """A tile's K steps and its step slots: the steps padded to a multiple of K_GROUPS, so group g takes steps
    g, g + K_GROUPS, ... of every tile (see _tile_sums).  Loader and MMA warps must count the same slots."""
    steps = kp // (128 * CHUNKS)
    return steps, gl.cdiv(steps, K_GROUPS) * K_GROUPS


@gluon.jit
def _loader(
    args,
    TOP_K: gl.constexpr,
    IS_GEMM1: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNKS: gl.constexpr,
    K_GROUPS: gl.constexpr,
    LOADER_WARPS: gl.constexpr,
    PAIR_TILES: gl.constexpr,
    HAS_MAP: gl.constexpr,
    PDL: gl.constexpr,
):
    (a_ptr, stride_a, w_desc, s_desc, tile_map, a_smem, w_smem, s_smem, ready, empty, n_out, k, kp) = args
    UNITS: gl.constexpr = BLOCK_N // 64
    A_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LOADER_WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    num_n_tiles = gl.cdiv(n_out, BLOCK_N)
    n_units = gl.cdiv(n_out, 64)
    matrices = HALVES * n_units
    steps, slots = _tile_steps(kp, CHUNKS, K_GROUPS)
    early = steps * 0  # stages of the first tile whose weights were issued before the previous kernel ended
    if not IS_GEMM1:
        # GEMM2 reads only its token rows from GEMM1: its first tile's weights stream in while GEMM1 still runs
        # (the tile map is the routing kernel's, which ended before GEMM1 let this kernel launch; topk_ids, read
        # with PAIR_TILES, come from a kernel before GEMM1 too)
        num_m_tiles = _token_tiles(tile_map, PAIR_TILES)
        if pid < num_m_tiles * num_n_tiles:
            n_tile, expert, row0, row_end = _tile(pid, num_m_tiles, num_n_tiles, tile_map, PAIR_TILES, HAS_MAP)
            early = gl.minimum(steps, STAGES) * _has_rows(row0, row_end, PAIR_TILES)
            for step in range(early):  # the ring's first uses: every stage is free
                _stage_weights(
                    w_desc,
                    s_desc,
                    w_smem,
                    s_smem,
                    ready.index(step),
                    step,
                    step,
                    expert * matrices + n_tile * UNITS,
                    n_units,
                    True,
                    HALVES,
                    UNITS,
                    CHUNKS,
                )
    _after_previous_kernel(PDL)
    num_m_tiles = _token_tiles(tile_map, PAIR_TILES)
    it = 0
    for mn in range(pid, num_m_tiles * num_n_tiles, gl.num_programs(0)):
        n_tile, expert, row0, row_end = _tile(mn, num_m_tiles, num_n_tiles, tile_map, PAIR_TILES, HAS_MAP)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_L))
        row_ok = rows < row_end
        if IS_GEMM1:
            a_rows = _pair_ids(tile_map, rows, row_ok, PAIR_TILES) // TOP_K
        else:
            a_rows = gl.where(row_ok, rows, row0)
        kk = gl.arange(0, 128, layout=gl.SliceLayout(0, A_L))
        a_ptrs = a_ptr + a_rows.to(gl.int64)[:, None] * stride_a + kk[None, :]
        unit0 = expert * matrices + n_tile * UNITS
        # a padding slot (step >= steps) loads nothing (its token rows' copies are all masked off) and only
        # passes its stage on; a tile without rows has no slots
        for step in range(slots * _has_rows(row0, row_end, PAIR_TILES)):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            real = step < steps
            if K_GROUPS > 1:
                mbarrier.arrive(bar, pred=step >= steps)  # in place of the weights' expect-arrive
            # the weights first: their boxes need only the tile's expert, the token rows also its pair ids (one
            # more dependent load at a tile's start)
            _stage_weights(
                w_desc,
                s_desc,
                w_smem,
                s_smem,
                bar,
                s,
                step,
                unit0,
                n_units,
                real & (it >= early),
                HALVES,
                UNITS,
                CHUNKS,
            )
            for c in gl.static_range(CHUNKS):
                chunk = step * CHUNKS + c
                k_ok = (chunk * 128 + kk) < k
                async_copy.async_copy_global_to_shared(
                    a_smem.index(s * CHUNKS + c), a_ptrs + chunk * 128, mask=row_ok[:, None] & k_ok[None, :]
                )
            async_copy.mbarrier_arrive(bar, increment_count=False)
            it += 1


@gluon.jit
def _decode_tile(w_smem, s_smem, BLOCK_N: gl.constexpr, DTYPE: gl.constexpr, NW: gl.constexpr, DOT_L: gl.constexpr):
    """One stage's BLOCK_N x 128 weights of one matrix, from FragmentLayout bytes in shared memory to the
    wgmma A operand registers.  Thread (warp, r, q) of 64-row unit u reads slot 128 u + 32 warp + 4 r + q:
    its 32 value bytes and its row pair's 16 scale bytes (the four q threads read the same ones)."""
    PAIRS: gl.constexpr = BLOCK_N // 2
    P_L: gl.constexpr = gl.BlockedLayout([1, 1, 32], [8, 4, 1], [NW, 1, 1], [2, 1, 0])
    S_L: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [NW, 1, 1], [2, 1, 0])
    FRAG: gl.constexpr = [BLOCK_N // 16, 8, 4, 8, 2, 2]  # [warp row block, r, q, g, kh, kp] of lo / hi
    p = w_smem.reshape([PAIRS, 4, 32]).load(P_L)
    # each thread's 16 scale bytes, then as the decode wants them: a word pair's four, twice
    s8 = s_smem.reshape([PAIRS, 1, 16]).load(S_L).broadcast_to([PAIRS, 4, 16]).reshape([PAIRS, 4, 4, 1, 4])
    s8 = gl.convert_layout(s8.broadcast_to([PAIRS, 4, 4, 2, 4]).reshape([PAIRS, 4, 32]), P_L, assert_trivial=True)
    lo, hi = _decode_words(p, s8, DTYPE)
    # the same relabelling as gemm_triton._decode_fragments: these registers already are the A operand
    w = gl.join(gl.reshape(lo, FRAG), gl.reshape(hi, FRAG))
    w = gl.reshape(gl.permute(w, (0, 6, 1, 3, 4, 2, 5)), [BLOCK_N, 128])
    return gl.convert_layout(w, DOT_L, assert_trivial=True)


@gluon.jit
def _consumer(
    shared,
    epilogue,
    IS_GEMM1: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DTYPE: gl.constexpr,
    NW: gl.constexpr,
    CHUNKS: gl.constexpr,
    GROUP: gl.constexpr,
    K_GROUPS: gl.constexpr,
    NARROW: gl.constexpr,
    PAIR_TILES: gl.constexpr,
    HAS_MAP: gl.constexpr,
    PDL: gl.constexpr,
):
    """One MMA warp group (GROUP of K_GROUPS), which takes every K_GROUPS-th K step of each tile; group 0 adds
    group 1's sums (from shared memory, in the same order wherever the tile runs: the same bits) and runs the
    epilogue.  ``shared``: the run-time arguments every group takes (a tuple, so the kernel names them once for
    all groups); ``epilogue``: the kernel's common.Epilogue.  A tile whose rows fit in BLOCK_M / 2 (NARROW >= 1)
    or BLOCK_M / 4 (NARROW 2) runs its MMAs that narrow: the tile holds the largest expert, and the smaller ones pay
    for their own width only (every group of the tile picks the same width from the same rows)."""
    (
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
        topk_weights_ptr,
        n_out,
        kp,
    ) = shared
    _after_previous_kernel(PDL)
    pid = gl.program_id(0)
    num_m_tiles = _token_tiles(tile_map, PAIR_TILES)
    num_n_tiles = gl.cdiv(n_out, BLOCK_N)
    steps, slots = _tile_steps(kp, CHUNKS, K_GROUPS)
    # the epilogue's loads as a tile starts, but GEMM1's in narrow-2 builds: held through their three K loops, its
    # global scales made the 8-warp one spill
    EARLY: gl.constexpr = NARROW < 2 or not IS_GEMM1
    tiles_done = 0
    for mn in range(pid, num_m_tiles * num_n_tiles, gl.num_programs(0)):
        n_tile, expert, row0, row_end = _tile(mn, num_m_tiles, num_n_tiles, tile_map, PAIR_TILES, HAS_MAP)
        tile = (n_tile, expert, row0, row_end, tiles_done * slots, tiles_done & 1, steps, slots)
        rows = row_end - row0
        # a constexpr False left of `and` makes the `if` static: widths NARROW does not allow are never built
        if PAIR_TILES:  # one row a tile: the narrowest width built (and one K loop, not one per width)
            if rows > 0:
                _tile_sums(
                    shared,
                    tile,
                    epilogue,
                    IS_GEMM1,
                    HALVES,
                    BLOCK_N,
                    BLOCK_M >> NARROW,
                    STAGES,
                    DTYPE,
                    NW,
                    CHUNKS,
                    GROUP,
                    K_GROUPS,
                    EARLY,
                    PAIR_TILES,
                )
        elif NARROW >= 2 and rows <= BLOCK_M // 4:
            _tile_sums(
                shared,
                tile,
                epilogue,
                IS_GEMM1,
                HALVES,
                BLOCK_N,
                BLOCK_M // 4,
                STAGES,
                DTYPE,
                NW,
                CHUNKS,
                GROUP,
                K_GROUPS,
                EARLY,
                PAIR_TILES,
            )
        elif NARROW >= 1 and rows <= BLOCK_M // 2:
            _tile_sums(
                shared,
                tile,
                epilogue,
                IS_GEMM1,
                HALVES,
                BLOCK_N,
                BLOCK_M // 2,
                STAGES,
                DTYPE,
                NW,
                CHUNKS,
                GROUP,
                K_GROUPS,
                EARLY,
                PAIR_TILES,
            )
        else:
            _tile_sums(
                shared,
                tile,
                epilogue,
                IS_GEMM1,
                HALVES,
                BLOCK_N,
                BLOCK_M,
                STAGES,
                DTYPE,
                NW,
                CHUNKS,
                GROUP,
                K_GROUPS,
                EARLY,
                PAIR_TILES,
            )
        tiles_done += _has_rows(row0, row_end, PAIR_TILES)


@gluon.jit
def _tile_sums(
    shared,
    tile,
    epilogue,
    IS_GEMM1: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    WIDTH: gl.constexpr,
    STAGES: gl.constexpr,
    DTYPE: gl.constexpr,
    NW: gl.constexpr,
    CHUNKS: gl.constexpr,
    GROUP: gl.constexpr,
    K_GROUPS: gl.constexpr,
    EARLY: gl.constexpr,
    PAIR_TILES: gl.constexpr,
):
    """One tile's K steps for this group, with MMAs WIDTH tokens wide (the first WIDTH rows of each stage's token
    rows), then its sums handed to group 0 or, in group 0, the epilogue (EARLY: its loads issued as the tile
    starts, so they return while the K steps run)."""
    (
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
        topk_weights_ptr,
        n_out,
        kp,
    ) = shared
    n_tile, expert, row0, row_end, base, phase, steps, slots = tile
    UNITS: gl.constexpr = BLOCK_N // 64
    # MMAs left running while the next A operand decodes: an operand is 32 registers per 16 rows a warp
    # holds; two in flight at 16 rows, one at 32 (ptxas waits on every wgmma when three 64-register
    # operands are live)
    IN_FLIGHT: gl.constexpr = 2 if BLOCK_N == 16 * NW else 1
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, WIDTH, 16])
    DOT_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_L, k_width=2)
    # the groups' sums buffers viewed as [BLOCK_N, WIDTH] each: producer and consumer of a tile share the view
    sums = sums_smem._reinterpret(
        gl.float32, [sums_smem.shape[0], BLOCK_N, WIDTH], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    acc = gl.zeros([BLOCK_N, WIDTH], gl.float32, MMA_L)
    acc_up = gl.zeros([BLOCK_N, WIDTH], gl.float32, MMA_L)
    if GROUP == 0 and EARLY:
        operands = _epilogue_operands(
            expert, row0, row_end, gs_ptr, tile_map, IS_GEMM1, HALVES, WIDTH, MMA_L, PAIR_TILES
        )
    # Group g takes steps g, g + K_GROUPS, ... of every tile (the loader pads each tile's steps to a multiple of
    # K_GROUPS), so group 0 adding the others' sums in group order adds them in step order wherever the tile
    # falls in the program's run: where a row's tile lands (the routing's atomics order an expert's rows
    # differently from run to run) never changes its bits.  With STAGES a multiple of K_GROUPS each stage
    # then always serves one group, which waits for its uses in order, so a stage's barrier is never more than
    # one phase ahead of its waiter.
    for step in range(GROUP, steps, K_GROUPS):
        it = base + step
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        fence_async_shared()  # the token rows came by cp.async (generic proxy); wgmma reads them async
        # The stage's MMAs in order (gate, up per chunk), at most IN_FLIGHT of them left running while the
        # next one decodes.  wgmma reads its A registers asynchronously: an operand is a dep of the wait
        # that retires its MMA, so nothing reuses its registers before.  The stage ends with all retired:
        # an operand carried into the next iteration was seen moved to new registers at the loop back-edge
        # while its MMA still read the old ones (wrong sums).
        older = gl.zeros([BLOCK_N, 128], DTYPE, DOT_L)  # the A operands of the MMAs still running
        newer = older
        for c in gl.static_range(CHUNKS):
            b = a_smem.index(s * CHUNKS + c).slice(0, WIDTH).permute((1, 0))
            for h in gl.static_range(HALVES):
                w = w_smem.index(s * HALVES + h)._reinterpret(gl.uint8, [CHUNKS, UNITS * 32, 128], _W_TILE)
                sc = s_smem.index(s * HALVES + h)._reinterpret(gl.uint8, [CHUNKS, UNITS * 4, 128], _S_TILE)
                a = _decode_tile(w.index(c), sc.index(c), BLOCK_N, DTYPE, NW, DOT_L)
                if h == 0:
                    acc = warpgroup_mma(a, b, acc, is_async=True)
                else:
                    acc_up = warpgroup_mma(a, b, acc_up, is_async=True)
                if c * HALVES + h >= IN_FLIGHT:  # retire the oldest MMA still running
                    warpgroup_mma_wait(IN_FLIGHT, deps=(older,))
                if IN_FLIGHT == 1:
                    older = a
                else:
                    older = newer
                    newer = a
        acc, acc_up, older, newer = warpgroup_mma_wait(0, deps=(acc, acc_up, older, newer))
        mbarrier.arrive(empty.index(s))
    last = slots - K_GROUPS + GROUP  # this group's last slot of the tile
    if K_GROUPS > 1 and last >= steps:  # a padding slot: no step, only its stage to pass back
        it = base + last
        mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(it % STAGES))
    if GROUP > 0:  # hand this group's sums to group 0
        mbarrier.wait(sums_free.index(GROUP - 1), phase ^ 1)
        sums.index(HALVES * (GROUP - 1)).store(acc)
        if HALVES == 2:
            sums.index(HALVES * (GROUP - 1) + 1).store(acc_up)
        mbarrier.arrive(sums_full.index(GROUP - 1))
    else:
        for g in gl.static_range(K_GROUPS - 1):
            mbarrier.wait(sums_full.index(g), phase)
            acc += sums.index(HALVES * g).load(MMA_L)
            if HALVES == 2:
                acc_up += sums.index(HALVES * g + 1).load(MMA_L)
            mbarrier.arrive(sums_free.index(g))
        if not EARLY:
            operands = _epilogue_operands(
                expert, row0, row_end, gs_ptr, tile_map, IS_GEMM1, HALVES, WIDTH, MMA_L, PAIR_TILES
            )
        _epilogue(
            acc,
            acc_up,
            n_tile,
            expert,
            row0,
            row_end,
            operands,
            out_ptr,
            stride_out,
            topk_weights_ptr,
            n_out,
            epilogue,
            IS_GEMM1,
            HALVES,
            BLOCK_N,
            WIDTH,
            DTYPE,
            MMA_L,
        )


@gluon.jit
def _epilogue_operands(
    expert,
    row0,
    row_end,
    gs_ptr,
    tile_map,
    IS_GEMM1: gl.constexpr,
    HALVES: gl.constexpr,
    WIDTH: gl.constexpr,
    MMA_L: gl.constexpr,
    PAIR_TILES: gl.constexpr,
):
    """What a tile's epilogue loads but GEMM2's top-k weights (they wait on its pair ids) and the biases: GEMM1's
    gate and up global scales (one without up rows), GEMM2's global scale and pair ids (its output rows).  At
    decode a tile's K steps take about as long as a few loads one after another, so these are loaded as the tile
    starts (_tile_sums' EARLY)."""
    if HALVES == 2:
        return gl.load(gs_ptr + expert * 2), gl.load(gs_ptr + expert * 2 + 1)
    elif IS_GEMM1:  # the scale twice: the operands keep one shape
        scale = gl.load(gs_ptr + expert)
        return scale, scale
    else:
        rows = row0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, MMA_L))
        return gl.load(gs_ptr + expert), _pair_ids(tile_map, rows, rows < row_end, PAIR_TILES)


@gluon.jit
def _epilogue(
    acc,
    acc_up,
    n_tile,
    expert,
    row0,
    row_end,
    operands,
    out_ptr,
    stride_out,
    topk_weights_ptr,
    n_out,
    epilogue,
    IS_GEMM1: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    WIDTH: gl.constexpr,
    DTYPE: gl.constexpr,
    MMA_L: gl.constexpr,
):
    """A tile's whole-K sums out (``operands`` from _epilogue_operands), gemm_triton._tile_sums_and_store's epilogue
    (common.Epilogue): GEMM1 act(gate + bias, up + bias) in DTYPE (SiLU(gate) * up by default); GEMM2
    (acc + bias) times the pairs' top-k weights."""
    # decoded values are value * 2^-126 (bf16) or * 2^-14 (fp16), undone here with the global scales
    FIX: gl.constexpr = BF16_EPILOGUE_FIX if DTYPE == gl.bfloat16 else FP16_EPILOGUE_FIX
    rows = row0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, MMA_L))
    row_ok = rows < row_end
    offs_n = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_L))
    store_mask = (offs_n < n_out)[:, None] & row_ok[None, :]
    bias_ptr = epilogue[0]
    if bias_ptr is not None:  # one [E, HALVES n_out] float32 row per expert
        bias_row = bias_ptr + expert.to(gl.int64) * (HALVES * n_out) + offs_n
        n_ok = offs_n < n_out
    if HALVES == 2:
        gate_scale, up_scale = operands
        gate = acc * (gate_scale * FIX)
        up = acc_up * (up_scale * FIX)
        if bias_ptr is not None:
            gate += gl.load(bias_row, mask=n_ok, other=0.0)[:, None]
            up += gl.load(bias_row + n_out, mask=n_ok, other=0.0)[:, None]
        y = _activation(gate, up, epilogue, True)
        gl.store(out_ptr + rows.to(gl.int64)[None, :] * stride_out + offs_n[:, None], y.to(DTYPE), mask=store_mask)
    elif IS_GEMM1:  # GEMM1 without up rows
        scale, _ = operands
        h = acc * (scale * FIX)
        if bias_ptr is not None:
            h += gl.load(bias_row, mask=n_ok, other=0.0)[:, None]
        y = _activation(h, h, epilogue, True)
        gl.store(out_ptr + rows.to(gl.int64)[None, :] * stride_out + offs_n[:, None], y.to(DTYPE), mask=store_mask)
    else:
        scale, pair_id = operands
        if bias_ptr is not None:
            y = acc * (scale * FIX) + gl.load(bias_row, mask=n_ok, other=0.0)[:, None]
            if epilogue[4]:
                y = y * gl.load(topk_weights_ptr + pair_id, mask=row_ok, other=0.0)[None, :]
        elif epilogue[4]:
            weight = gl.load(topk_weights_ptr + pair_id, mask=row_ok, other=0.0)
            y = acc * (scale * FIX * weight)[None, :]
        else:
            y = acc * (scale * FIX)
        gl.store(
            out_ptr + pair_id.to(gl.int64)[None, :] * stride_out + offs_n[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


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
    topk_weights_ptr,
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
    HALVES: gl.constexpr = 2 if epilogue[5] else 1  # gate and up matrices (common.Epilogue.GATE_UP)
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
        topk_weights_ptr,
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
    """TMA views of FragmentLayout weights, whose (unit u, K chunk c) block sits at u * chunks_k + c: dims
    [chunk, unit, row, byte] (innermost last), so one box holds ``units`` consecutive 64-row units by
    ``chunks`` K chunks, chunk-major: value rows of 128 bytes (a 4 KiB block per unit and chunk) and scale
    rows (512 bytes).  Rows of 128 bytes: with 32-byte rows the same boxes streamed at 2.9 TB/s, with
    128-byte rows at 3.6 (H200, loads alone).  The 128-byte swizzle keeps the MMA warps' 16-byte reads
    (thread t: bytes 32 t .. 32 t + 31) free of bank conflicts."""
    fragments = FragmentLayout()  # host ints (BLOCK_BYTES and SCALE_BLOCK_BYTES are the kernels' constexprs)
    chunks_k = kp // fragments.chunk_k
    n_units = w_packed.numel() // (chunks_k * fragments.block_bytes)

    def view(t: torch.Tensor, block: int, layout: gl.NVMMASharedLayout) -> TensorDescriptor:
        rows = block // 128
        return TensorDescriptor(
            t.reshape(-1),
            [chunks_k, n_units, rows, 128],
            [block, chunks_k * block, 128, 1],
            [chunks, units, rows, 128],
            layout,
        )

    return view(w_packed, fragments.block_bytes, _W_BOX), view(w_scale, fragments.scale_block_bytes, _S_BOX)


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
    out[pair] = routing weight * (a[row] @ W^T).  a [rows, K] and out [rows, N] in 16-byte aligned rows; ``sms``
    programs per GemmConfig.programs_per_sm.  With ``routing.pair_tiles`` the tile map goes unread and no routing
    kernel needs to run.  A pair routed nowhere (routing.routed_pairs) is skipped: its output row is not written."""
    gemm = config.gemm1 if is_gemm1 else config.gemm2
    kp = weights.packed.shape[-1] * 2
    w_desc, s_desc = _descriptors(weights.packed, weights.scale, kp, gemm.block_n // 64, gemm.chunks_per_stage)
    num_experts = weights.packed.shape[0]
    ids, expert_map = routing.topk_ids, routing.expert_map
    has_map = routing.pair_tiles and expert_map is not None  # routed tiles hold local experts already
    topk_weights = routing.topk_weights if is_gemm1 else routing.topk_weights.reshape(-1)  # GEMM1 reads none
    pdl = triton_common._dependent_launch(a.device)["PDL"]
    _moe_gemm_ws_kernel[(sms * gemm.programs_per_sm,)](
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
        topk_weights,
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
