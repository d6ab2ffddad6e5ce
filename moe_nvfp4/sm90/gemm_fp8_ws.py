"""The W4A8 mode's grouped GEMM, warp-specialized and cooperative (Gluon; issue 58, design 008 decisions 6-7):
gemm_fp8's contract and sums, with the loads of the next tiles running ahead of the MMAs.

One loader warp issues each stage's two TMA boxes (weights [128 rows, BLOCK_K], token rows [BLOCK_M, BLOCK_K]) into
a ring, running ahead across tiles.  Two MMA warp groups take every tile together, each on half its token rows, so a
stage serves both (it is freed once both read it).  A group holds a tile's 128 weight rows as two 64-row
accumulators (one m64 wgmma each): GEMM1's gate rows and their up rows (weight_layouts.FP8_GATE_UP_BLOCK), or two
halves of GEMM2's.  Each K step's MMAs sum into fresh partials that are added into the fp32 accumulators while the
next step's MMAs run (the promotion every BLOCK_K, at most 128: _fp8_mma), which is why a group's token side is at
most 64 rows: the accumulators and three partials at 64 x 64 are 160 registers a thread.  Where GEMM2's whole K of
a token tile fits beside the ring (token_panel), the token rows stay in shared memory for a unit of weight tiles and
the ring streams weight boxes only (design 008 decision 10).  The ping-pong form (each group on alternate tiles,
its epilogue under the other's MMAs) read half the bytes a MMA and lost: 0.81-1.01x W4A16 where this form made
1.08-1.38x (design 008 decision 7).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton import common as triton_common
from ..triton.launcher import launch
from .common import Epilogue, GemmRouting, _activation, _grouped_tile
from .gemm_fp8 import WEIGHT_ROWS, Fp8GemmOperands, Fp8Tiles
from .gemm_gluon_loader import _after_previous_kernel

__all__ = ["launch_fp8_ws"]

HALF: gl.constexpr = gl.constexpr(64)  # weight rows an accumulator; a tile is two
LOADER_REGISTERS = gl.constexpr(40)
MMA_REGISTERS = gl.constexpr(
    232
)  # group 1's (setmaxnreg); maxnreg 168 x 12 warps less the loader's group, shared by 8 warps


@gluon.jit
def _program_tile(i, tile_map, num_n_tiles, CHUNK_N: gl.constexpr):
    """This program's i-th tile: its n tile, expert, first sorted row and end of rows.  CHUNK_N 0: programs take
    tiles pid, pid + programs, ... in gemm_triton's grouped order; else units of CHUNK_N n tiles of one token tile
    (pid, pid + programs, ... token-tile major), a unit's tiles in turn, so its token rows are loaded once."""
    num_m_tiles = gl.load(tile_map[4])
    if CHUNK_N == 0:
        mn = gl.program_id(0) + i * gl.num_programs(0)
        m_tile, n_tile = _grouped_tile(mn, num_m_tiles, num_n_tiles)
    else:
        unit = gl.program_id(0) + (i // CHUNK_N) * gl.num_programs(0)
        chunks = num_n_tiles // CHUNK_N
        m_tile = unit // chunks
        n_tile = (unit % chunks) * CHUNK_N + i % CHUNK_N
    return n_tile, gl.load(tile_map[1] + m_tile), gl.load(tile_map[2] + m_tile), gl.load(tile_map[3] + m_tile)


@gluon.jit
def _program_tiles(tile_map, num_n_tiles, CHUNK_N: gl.constexpr):
    """How many tiles this program takes (whole units where CHUNK_N > 0)."""
    per = 1 if CHUNK_N == 0 else CHUNK_N
    total = gl.load(tile_map[4]) * (num_n_tiles // per)
    pid = gl.program_id(0)
    return gl.where(pid < total, (total - pid + gl.num_programs(0) - 1) // gl.num_programs(0), 0) * per


@gluon.jit
def _fp8_loader(
    args,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNK_N: gl.constexpr,
    PDL: gl.constexpr,
):
    """The loader warp: every tile's K steps in order, a stage each, weights then token rows on one barrier; with
    CHUNK_N the token rows go to the panel instead, once a unit, each K step's box when both groups are done with
    the last unit's (panel_empty)."""
    a_desc, w_desc, a_smem, w_smem, ready, empty, panel_ready, panel_empty, tile_map, n_rows, k, num_n_tiles = args
    _after_previous_kernel(PDL)
    steps = gl.cdiv(k, BLOCK_K)
    for i in range(_program_tiles(tile_map, num_n_tiles, CHUNK_N)):
        n_tile, expert, row0, row_end = _program_tile(i, tile_map, num_n_tiles, CHUNK_N)
        w_row = expert * n_rows + n_tile * (2 * HALF)
        for step in range(steps):
            if CHUNK_N > 0:
                if i % CHUNK_N == 0:  # a unit's first tile: its token rows into the panel
                    unit = i // CHUNK_N
                    mbarrier.wait(panel_empty.index(step), (unit & 1) ^ 1)
                    mbarrier.expect(panel_ready.index(step), BLOCK_M * BLOCK_K)
                    tma.async_copy_global_to_shared(
                        a_desc, [row0, step * BLOCK_K], panel_ready.index(step), a_smem.index(step)
                    )
            it = i * steps + step
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            # e4m3: a byte a value; with the panel the stage holds the weight box only
            mbarrier.expect(bar, (2 * HALF + (0 if CHUNK_N > 0 else BLOCK_M)) * BLOCK_K)
            tma.async_copy_global_to_shared(w_desc, [w_row, step * BLOCK_K], bar, w_smem.index(s))
            if CHUNK_N == 0:
                tma.async_copy_global_to_shared(a_desc, [row0, step * BLOCK_K], bar, a_smem.index(s))


@gluon.jit
def _half_out(h, n0, expert, rows, row_ok, out_rows, args, epilogue, IS_GEMM1: gl.constexpr, MMA_L: gl.constexpr):
    """One 64-row half of a non-gated tile out: bias, GEMM1's activation, store."""
    out_ptr, stride_out, n_out = args
    offs = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA_L))
    bias_ptr = epilogue[0]
    if bias_ptr is not None:
        h += gl.load(bias_ptr + expert.to(gl.int64) * n_out + offs, mask=offs < n_out, other=0.0)[:, None]
    if IS_GEMM1:
        h = _activation(h, h, epilogue, True)
    mask = (offs < n_out)[:, None] & row_ok[None, :]
    gl.store(
        out_ptr + out_rows.to(gl.int64)[None, :] * stride_out + offs[:, None], h.to(out_ptr.dtype.element_ty), mask=mask
    )


@gluon.jit
def _fp8_epilogue(acc0, acc1, tile, args, epilogue, IS_GEMM1: gl.constexpr, BLOCK_M: gl.constexpr, MMA_L: gl.constexpr):
    """A tile's sums out: scaled by each weight row's and token row's scale, then gemm_fp8's epilogue variants."""
    a_scale_ptr, w_scale_ptr, pairs_ptr, out_ptr, stride_out, n_out, n_rows = args
    n_tile, expert, row0, row_end = tile
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA_L))
    row_ok = rows < row_end
    a_scale = gl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    w_rows = expert * n_rows + n_tile * (2 * HALF) + gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA_L))
    last = (expert + 1) * n_rows
    w_scale0 = gl.load(w_scale_ptr + w_rows, mask=w_rows < last, other=0.0)[:, None]
    w_scale1 = gl.load(w_scale_ptr + w_rows + HALF, mask=w_rows + HALF < last, other=0.0)[:, None]
    out_rows = rows if IS_GEMM1 else gl.load(pairs_ptr + rows, mask=row_ok, other=0)
    out = (out_ptr, stride_out, n_out)
    if epilogue[4]:  # GATE_UP: h0 the gate rows, h1 their up rows
        h0 = acc0 * w_scale0 * a_scale
        h1 = acc1 * w_scale1 * a_scale
        offs = n_tile * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA_L))
        bias_ptr = epilogue[0]
        if bias_ptr is not None:
            bias_row = bias_ptr + expert.to(gl.int64) * (2 * n_out) + offs
            h0 += gl.load(bias_row, mask=offs < n_out, other=0.0)[:, None]
            h1 += gl.load(bias_row + n_out, mask=offs < n_out, other=0.0)[:, None]
        y = _activation(h0, h1, epilogue, True)
        mask = (offs < n_out)[:, None] & row_ok[None, :]
        gl.store(
            out_ptr + out_rows.to(gl.int64)[None, :] * stride_out + offs[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # one half scaled and stored at a time: fewer registers live at once
        h0 = acc0 * w_scale0 * a_scale
        _half_out(h0, n_tile * (2 * HALF), expert, rows, row_ok, out_rows, out, epilogue, IS_GEMM1, MMA_L)
        h1 = acc1 * w_scale1 * a_scale
        _half_out(h1, n_tile * (2 * HALF) + HALF, expert, rows, row_ok, out_rows, out, epilogue, IS_GEMM1, MMA_L)


@gluon.jit
def _stage(i, step, steps, bufs, STAGES: gl.constexpr, GROUP: gl.constexpr, WIDTH: gl.constexpr, CHUNK_N: gl.constexpr):
    """Wait for tile i's K step (its ring slot, and with CHUNK_N its panel box): the weight box and this group's
    token rows, as the MMA's operands."""
    a_smem, w_smem, ready, empty, panel_ready, panel_empty = bufs
    it = i * steps + step
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    if CHUNK_N > 0:
        mbarrier.wait(panel_ready.index(step), (i // CHUNK_N) & 1)
        b = a_smem.index(step).slice(GROUP * WIDTH, WIDTH).permute((1, 0))
    else:
        b = a_smem.index(s).slice(GROUP * WIDTH, WIDTH).permute((1, 0))
    return w_smem.index(s), b


@gluon.jit
def _half_mma(w, b, h: gl.constexpr, WIDTH: gl.constexpr, MMA_L: gl.constexpr):
    """Weight half h of a K step into a fresh partial sum, async."""
    zero = gl.zeros([HALF, WIDTH], gl.float32, MMA_L)
    return warpgroup_mma(w.slice(h * HALF, HALF), b, zero, use_acc=False, is_async=True)


@gluon.jit
def _retire_step(
    p0, p1, acc0, acc1, i, step, steps, bufs, STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, CHUNK_N: gl.constexpr
):
    """Wait until only IN_FLIGHT MMAs (the next step's first half, or none) are pending, add the step's partial sums
    into the fp32 accumulators (the promotion, design 008 decision 4) and free its ring slot (and at a unit's last
    tile its panel box)."""
    a_smem, w_smem, ready, empty, panel_ready, panel_empty = bufs
    p0, p1 = warpgroup_mma_wait(IN_FLIGHT, deps=(p0, p1))
    mbarrier.arrive(empty.index((i * steps + step) % STAGES))
    if CHUNK_N > 0:
        mbarrier.arrive(panel_empty.index(step), pred=i % CHUNK_N == CHUNK_N - 1)
    return acc0 + p0, acc1 + p1


@gluon.jit
def _fp8_mma(
    args,
    epilogue,
    IS_GEMM1: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNK_N: gl.constexpr,
    GROUP: gl.constexpr,
    PDL: gl.constexpr,
):
    """MMA warp group GROUP (0 or 1): every tile of this program, its half GROUP of the token rows.

    Each K step's sums go into fresh partials (the FP8 MMA sums in about 14 bits) that are added into fp32 once the
    step is done, while the next step's first half runs: the MMA's own promotion (max_num_imprecise_acc) reads its
    partial right after issuing it, which serializes every MMA (ptxas C7514).  The first halves alternate between
    two partials (A on even steps, B on odd: the next one is issued before this one is read), the second halves
    take one (issued after the step before is added): 160 accumulator registers, not 192."""
    bufs, tile_map, k, num_n_tiles, out_args = args
    _after_previous_kernel(PDL)
    WIDTH: gl.constexpr = BLOCK_M // 2  # this group's token rows a tile
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 32])
    steps = gl.cdiv(k, BLOCK_K)
    for i in range(_program_tiles(tile_map, num_n_tiles, CHUNK_N)):
        n_tile, expert, row0, row_end = _program_tile(i, tile_map, num_n_tiles, CHUNK_N)
        acc0 = gl.zeros([HALF, WIDTH], gl.float32, MMA_L)
        acc1 = gl.zeros([HALF, WIDTH], gl.float32, MMA_L)
        w, b = _stage(i, 0, steps, bufs, STAGES, GROUP, WIDTH, CHUNK_N)
        a0 = _half_mma(w, b, 0, WIDTH, MMA_L)
        q1 = _half_mma(w, b, 1, WIDTH, MMA_L)
        for pair in range((steps - 1) // 2):  # step 2 pair in flight at the top (first half in A)
            step = 2 * pair
            w, b = _stage(i, step + 1, steps, bufs, STAGES, GROUP, WIDTH, CHUNK_N)
            b0 = _half_mma(w, b, 0, WIDTH, MMA_L)
            acc0, acc1 = _retire_step(a0, q1, acc0, acc1, i, step, steps, bufs, STAGES, 1, CHUNK_N)
            q1 = _half_mma(w, b, 1, WIDTH, MMA_L)
            w, b = _stage(i, step + 2, steps, bufs, STAGES, GROUP, WIDTH, CHUNK_N)
            a0 = _half_mma(w, b, 0, WIDTH, MMA_L)
            acc0, acc1 = _retire_step(b0, q1, acc0, acc1, i, step + 1, steps, bufs, STAGES, 1, CHUNK_N)
            q1 = _half_mma(w, b, 1, WIDTH, MMA_L)
        last = steps - 1
        if steps % 2 == 0:  # one odd step left after the last even one
            w, b = _stage(i, last, steps, bufs, STAGES, GROUP, WIDTH, CHUNK_N)
            b0 = _half_mma(w, b, 0, WIDTH, MMA_L)
            acc0, acc1 = _retire_step(a0, q1, acc0, acc1, i, last - 1, steps, bufs, STAGES, 1, CHUNK_N)
            q1 = _half_mma(w, b, 1, WIDTH, MMA_L)
            acc0, acc1 = _retire_step(b0, q1, acc0, acc1, i, last, steps, bufs, STAGES, 0, CHUNK_N)
        else:
            acc0, acc1 = _retire_step(a0, q1, acc0, acc1, i, last, steps, bufs, STAGES, 0, CHUNK_N)
        tile = (n_tile, expert, row0 + GROUP * WIDTH, row_end)
        _fp8_epilogue(acc0, acc1, tile, out_args, epilogue, IS_GEMM1, WIDTH, MMA_L)


@gluon.jit
def _fp8_ws_kernel(
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
    IS_GEMM1: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PANEL: gl.constexpr,
    CHUNK_N: gl.constexpr,
    PDL: gl.constexpr,
):
    # PANEL > 0 (with CHUNK_N): a unit's token rows stay in shared memory, PANEL K steps of them, while its CHUNK_N
    # tiles stream only weight boxes through the ring
    A_SLOTS: gl.constexpr = PANEL if PANEL > 0 else STAGES
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [A_SLOTS, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * HALF, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    P_SLOTS: gl.constexpr = PANEL if PANEL > 0 else 1
    panel_ready = gl.allocate_shared_memory(gl.int64, [P_SLOTS, 1], mbarrier.MBarrierLayout())
    panel_empty = gl.allocate_shared_memory(gl.int64, [P_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both groups read every stage
    for i in gl.static_range(P_SLOTS):
        mbarrier.init(panel_ready.index(i), count=1)
        mbarrier.init(panel_empty.index(i), count=2)
    num_n_tiles = gl.cdiv(n_rows, 2 * HALF)
    tile_map = (sorted_pairs_ptr, tile_expert_ptr, tile_row_ptr, tile_row_end_ptr, num_tiles_ptr)
    out_args = (a_scale_ptr, w_scale_ptr, sorted_pairs_ptr, out_ptr, stride_out, n_out, n_rows)
    bufs = (a_smem, w_smem, ready, empty, panel_ready, panel_empty)
    mma = (bufs, tile_map, k, num_n_tiles, out_args)
    loader = (a_desc, w_desc, a_smem, w_smem, ready, empty, panel_ready, panel_empty, tile_map, n_rows, k, num_n_tiles)
    gl.warp_specialize(
        [
            (_fp8_mma, (mma, epilogue, IS_GEMM1, BLOCK_M, BLOCK_K, STAGES, CHUNK_N, 0, PDL)),
            (_fp8_mma, (mma, epilogue, IS_GEMM1, BLOCK_M, BLOCK_K, STAGES, CHUNK_N, 1, PDL)),
            (_fp8_loader, (loader, BLOCK_M, BLOCK_K, STAGES, CHUNK_N, PDL)),
        ],
        [4, 1],
        [MMA_REGISTERS, LOADER_REGISTERS],
    )


PANEL_SMEM = 200 * 1024  # shared memory the token panel and the weight ring may take (sm_90: 227 KB a block)
UNIT_TILES = (4, 2)  # n tiles a unit, the first that divides the GEMM's: the panel loaded once for 4 weight tiles


def token_panel(is_gemm1: bool, k: int, n_rows: int, tiles: Fp8Tiles) -> tuple[int, int]:
    """(K steps of token rows kept in shared memory, n tiles a unit), or (0, 0): GEMM2 where its whole K of a token
    tile fits beside the ring (I <= 1024 at 128 x 128 boxes and 4 stages), so each weight box streams with no token
    box beside it: half the bytes a K step from L2 (design 008 decisions 7 and 10)."""
    steps = -(-k // tiles.block_k)
    panel_bytes = (steps * tiles.block_m + tiles.num_stages * WEIGHT_ROWS) * tiles.block_k
    n_tiles = -(-n_rows // WEIGHT_ROWS)
    chunk = next((c for c in UNIT_TILES if n_tiles % c == 0), 0)
    if is_gemm1 or panel_bytes > PANEL_SMEM or not chunk:
        return 0, 0
    return steps, chunk


@functools.cache
def _box_layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The shared layout of an e4m3 TMA box: one object per box shape, built once (Gluon builds a layout through
    constexpr functions: 20-40 us of host time a launch, design 008 decision 12)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


def launch_fp8_ws(
    operands: Fp8GemmOperands,
    out: torch.Tensor,
    routing: GemmRouting,
    tiles: Fp8Tiles,
    epilogue: Epilogue,
    *,
    is_gemm1: bool,
    sms: int,
) -> None:
    """gemm_fp8.launch_fp8_gemm's contract on this kernel: one program an SM, 128 weight rows a tile,
    ``tiles.block_m`` token rows (32 to 128: half a warp group's), ``tiles.block_k`` K a stage, ``tiles.num_stages``
    stages."""
    rows, row_scale, weight, weight_scale, n_out = operands
    e, n_rows, k = weight.shape
    a_block, w_block = [tiles.block_m, tiles.block_k], [WEIGHT_ROWS, tiles.block_k]
    a_desc = TensorDescriptor.from_tensor(rows, a_block, _box_layout(*a_block))
    w_desc = TensorDescriptor.from_tensor(weight.view(e * n_rows, k), w_block, _box_layout(*w_block))
    panel, chunk_n = token_panel(is_gemm1, k, n_rows, tiles)
    pdl = triton_common._dependent_launch(rows.device)["PDL"]
    launch(
        _fp8_ws_kernel,
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
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        STAGES=tiles.num_stages,
        PANEL=panel,
        CHUNK_N=chunk_n,
        PDL=pdl,
        num_warps=4,
        maxnreg=168,
        launch_pdl=pdl,
    )
