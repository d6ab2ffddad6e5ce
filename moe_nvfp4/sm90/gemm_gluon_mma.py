"""The warp-specialized sm_90 MoE GEMM's MMA partitions (gemm_gluon): each MMA warp group waits for a ring stage
(gemm_gluon_loader fills it), decodes the stage's FP4 weights from shared memory into its wgmma A registers, runs the
MMAs against the token rows, and at a tile's end (K group 0) writes the epilogue, gemm_triton's sums and activations.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import BF16_EPILOGUE_FIX, FP16_EPILOGUE_FIX, _activation, _decode_words
from .gemm_gluon_loader import _after_previous_kernel, _has_rows, _pair_ids, _tile, _tile_steps, _token_tiles

# the MMA warps read one K chunk of a stage's TMA boxes (gemm_gluon's [chunks, units, rows, 128 bytes]) as the 2-d
# [units x rows, 128] tile they were laid out as
_W_TILE = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
_S_TILE = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


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
    """What a tile's epilogue loads but the biases: GEMM1's gate and up global scales (one without up rows), GEMM2's
    global scale and pair ids (its output rows).  At decode a tile's K steps take about as long as a few loads one
    after another, so these are loaded as the tile starts (_tile_sums' EARLY)."""
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
    acc + bias (the combine weights it)."""
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
        y = acc * (scale * FIX)
        if bias_ptr is not None:
            y += gl.load(bias_row, mask=n_ok, other=0.0)[:, None]
        gl.store(
            out_ptr + pair_id.to(gl.int64)[None, :] * stride_out + offs_n[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
