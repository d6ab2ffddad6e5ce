"""The warp-specialized sm_90 MoE GEMM's loader partition (gemm_gluon): the tile walk every partition shares (each
program's tiles in gemm_triton's order, from the routing kernel's tile map or one tile per pair) and the loader warp
group, which issues each stage's weight boxes by TMA and the token rows by cp.async into the ring of stages the MMA
warps (gemm_gluon_mma) read.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..triton.common import _routed
from .common import BLOCK_BYTES, SCALE_BLOCK_BYTES, _grouped_tile


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
