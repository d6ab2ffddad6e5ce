"""Routing on the GPU in Triton: topk_ids -> the routing plan (pairs grouped by expert, per-expert counts and
offsets, the tile map), what routing.plan_routing computes in torch; and vLLM's batched format's per-expert counts ->
its plan (``route_batched``, routing.plan_batched_routing's twin).  The sm_90 host (sm90.host) and the Blackwell
host (cute/moe_host) both launch it.  Up to ROUTE_ONE_PROGRAM pairs ``_route_kernel`` is one program; past that
``_count_kernel`` counts chunks of pairs first and ``_route_kernel`` scatters them, one program per chunk.  Grids are
sized from T, never from routing data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layouts import next_pow2, round_up
from . import common
from .common import _after_previous_kernel, _routed
from .launcher import launch


@triton.jit
def _local_experts(
    ids_ptr, expert_map_ptr, p0, num_pairs, num_global, num_experts, HAS_MAP: tl.constexpr, BLOCK_P: tl.constexpr
):
    """Pairs p0 .. p0+BLOCK_P: their local expert and whether they count (in range, routed to this rank)."""
    offs = p0 + tl.arange(0, BLOCK_P)
    in_range = offs < num_pairs
    e, valid = _routed(
        tl.load(ids_ptr + offs, mask=in_range, other=-1), in_range, expert_map_ptr, num_global, num_experts, HAS_MAP
    )
    return offs, e, valid


@triton.jit
def _expert_runs(counts, BLOCK_M: tl.constexpr):
    """Per-expert pair counts -> (first sorted row, token tiles, end of its tiles): the plan's layout."""
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return tl.cumsum(counts, 0) - counts, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _count_pairs(
    ids_ptr,
    expert_map_ptr,
    start,
    end,
    num_pairs,
    num_global,
    num_experts,
    HAS_MAP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """Pairs per local expert among pairs start .. end (end - start a multiple of BLOCK_P, or the last pairs)."""
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(start, end, BLOCK_P):
        _, e, valid = _local_experts(ids_ptr, expert_map_ptr, p0, num_pairs, num_global, num_experts, HAS_MAP, BLOCK_P)
        counts += tl.histogram(tl.where(valid, e, 0), E_POW2, mask=valid)
    return counts


# The pair and chunk counts change with T: not specialized on, so a new T never compiles a new variant.
@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_kernel(
    ids_ptr,
    expert_map_ptr,
    hist_ptr,
    num_pairs,
    chunk,
    num_global,
    num_experts,
    HAS_MAP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    E_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Routing, first of two launches past ROUTE_ONE_PROGRAM pairs: program c counts chunk c's pairs per
    expert into row c of hist (E_POW2 wide), which _route_kernel turns into each chunk's first rows."""
    _after_previous_kernel(PDL)
    c = tl.program_id(0)
    counts = _count_pairs(
        ids_ptr,
        expert_map_ptr,
        c * chunk,
        tl.minimum(c * chunk + chunk, num_pairs),
        num_pairs,
        num_global,
        num_experts,
        HAS_MAP,
        BLOCK_P,
        E_POW2,
    )
    tl.store(hist_ptr + c * E_POW2 + tl.arange(0, E_POW2), counts)


# The pair, chunk and tile counts change with T: not specialized on, so a new T never compiles a new variant.
@triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks", "max_tiles"])
def _route_kernel(
    ids_ptr,
    expert_map_ptr,
    hist_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    offsets_ptr,
    cursor_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_row_end_ptr,
    num_tiles_ptr,
    num_pairs,
    chunk,
    num_chunks,
    num_global,
    num_experts,
    max_tiles,
    COUNTED: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    E_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program c scatters chunk c's pairs into their experts' runs; program 0 also writes the counts, offsets
    and tile map.  COUNTED: _count_kernel has counted every chunk (one program per chunk, so the scatters'
    atomics run on as many SMs); otherwise one program counts and scatters every pair (one launch)."""
    _after_previous_kernel(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    expert_ok = experts < num_experts
    if COUNTED:
        chunks = tl.arange(0, MAX_CHUNKS)
        hist = tl.load(
            hist_ptr + chunks[:, None] * E_POW2 + experts[None, :], mask=(chunks < num_chunks)[:, None], other=0
        )
        counts = tl.sum(hist, 0)
        before = tl.sum(tl.where((chunks < c)[:, None], hist, 0), 0)  # this expert's pairs in earlier chunks
    else:
        counts = _count_pairs(
            ids_ptr, expert_map_ptr, 0, num_pairs, num_pairs, num_global, num_experts, HAS_MAP, BLOCK_P, E_POW2
        )
        before = tl.zeros([E_POW2], dtype=tl.int32)
    starts, tiles, tile_ends = _expert_runs(counts, BLOCK_M)
    # Scatter: the order inside a chunk's part of an expert's run may vary between runs, which changes no
    # result (each row's dot products are independent of its neighbours and the combine is by pair index).
    cursor = cursor_ptr + c * E_POW2 + experts
    tl.store(cursor, starts + before)
    tl.debug_barrier()
    for p0 in range(c * chunk, tl.minimum(c * chunk + chunk, num_pairs), BLOCK_P):
        offs, e, valid = _local_experts(
            ids_ptr, expert_map_ptr, p0, num_pairs, num_global, num_experts, HAS_MAP, BLOCK_P
        )
        pos = tl.atomic_add(cursor_ptr + c * E_POW2 + e, 1, mask=valid)
        tl.store(sorted_pairs_ptr + pos, offs, mask=valid)
    if c == 0:
        tl.store(counts_ptr + experts, counts, mask=expert_ok)
        tl.store(offsets_ptr + experts, starts, mask=expert_ok)
        tl.store(offsets_ptr + experts + 1, starts + counts, mask=experts == num_experts - 1)
        tl.store(num_tiles_ptr, tl.sum(tiles, 0))
        # Tile map: expert e owns tiles [tile_ends[e] - tiles[e], tile_ends[e]); tiles past the total are unused.
        first_tile = tile_ends - tiles
        for j in range(0, tl.max(tiles, 0)):
            owned = expert_ok & (j < tiles)
            tl.store(tile_expert_ptr + first_tile + j, experts, mask=owned)
            tl.store(tile_row_ptr + first_tile + j, starts + j * BLOCK_M, mask=owned)
            tile_end = tl.minimum(starts + (j + 1) * BLOCK_M, starts + counts)
            tl.store(tile_row_end_ptr + first_tile + j, tile_end, mask=owned)
        for t0 in range(tl.sum(tiles, 0), max_tiles, BLOCK_P):
            t = t0 + tl.arange(0, BLOCK_P)
            tl.store(tile_expert_ptr + t, tl.full([BLOCK_P], -1, tl.int32), mask=t < max_tiles)
            tl.store(tile_row_ptr + t, tl.zeros([BLOCK_P], tl.int32), mask=t < max_tiles)
            tl.store(tile_row_end_ptr + t, tl.zeros([BLOCK_P], tl.int32), mask=t < max_tiles)


ROUTE_BLOCK_SMALL = 128  # up to this many pairs one routing program takes them in one step (decode sizes)
ROUTE_ONE_PROGRAM = 1024  # up to this many, one program in steps of this many; past it, counted chunks
ROUTE_BLOCK = 256  # pairs a routing program takes per step in the counted path, in chunks of such steps
ROUTE_HIST_ELEMENTS = 16384  # the chunk-by-expert counts _route_kernel loads at once (registers of 8 warps)
ROUTE_MAX_CHUNKS = 128  # programs of the counted path at most (about the SM count: each scatters its own chunk)


def routing_variants_from(top_k: int) -> list[int]:
    """The token counts at which route() starts launching another compiled variant (after T=1)."""
    return [ROUTE_BLOCK_SMALL // top_k + 1, ROUTE_ONE_PROGRAM // top_k + 1]


def _route_max_chunks(e_pow2: int) -> int:
    """Chunks of the counted routing path at most, for E rounded up to a power of two: the table fits."""
    return max(1, min(ROUTE_MAX_CHUNKS, ROUTE_HIST_ELEMENTS // e_pow2))


def route_chunks(num_pairs: int, num_experts: int) -> tuple[int, int]:
    """(pairs per chunk, chunks) of the counted routing path: whole ROUTE_BLOCK steps per chunk, at most
    _route_max_chunks chunks.  Depends on T and E only, never on the routing."""
    steps = -(-num_pairs // ROUTE_BLOCK)
    chunk = -(-steps // _route_max_chunks(next_pow2(num_experts))) * ROUTE_BLOCK
    return chunk, -(-num_pairs // chunk)


def route(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Launch the routing kernel(s); returns (sorted_pairs, counts, offsets, tile_expert, tile_row, tile_row_end,
    num_tiles) as in routing.RoutingPlan.  Up to ROUTE_ONE_PROGRAM pairs one program does it all (one launch);
    past that _count_kernel counts chunks of pairs and _route_kernel scatters them, a program per chunk: one
    program's atomics serialize at large counts, chunks cost a launch at small ones (design 002, decision 6)."""
    from ..routing import max_tiles

    num_pairs = topk_ids.numel()
    e_pow2 = next_pow2(num_experts)
    counted = num_pairs > ROUTE_ONE_PROGRAM
    chunk, num_chunks = route_chunks(num_pairs, num_experts) if counted else (num_pairs, 1)
    n_tiles = max_tiles(num_pairs, num_experts, block_m)
    hist_size = num_chunks * e_pow2 if counted else 0
    sizes = (num_pairs, num_experts, num_experts + 1, num_chunks * e_pow2, n_tiles, n_tiles, n_tiles, 1, hist_size)
    # One allocation; each part starts on a 16-byte boundary, the alignment Triton specializes pointers
    # on, so the kernels see the same pointer properties for every T (no recompilation).
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + round_up(size, 4))
    ints = torch.empty(starts[-1], dtype=torch.int32, device=topk_ids.device)
    sorted_pairs, counts, offsets, cursor, tile_expert, tile_row, tile_row_end, num_tiles, hist = (
        ints[start : start + size] for start, size in zip(starts, sizes)
    )
    ids = topk_ids.reshape(-1)
    emap = ids if expert_map is None else expert_map
    num_global = num_experts if expert_map is None else expert_map.numel()
    block_p = ROUTE_BLOCK if counted else ROUTE_BLOCK_SMALL if num_pairs <= ROUTE_BLOCK_SMALL else ROUTE_ONE_PROGRAM
    pdl = common._dependent_launch(topk_ids.device)
    if counted:
        launch(
            _count_kernel,
            (num_chunks,),
            ids,
            emap,
            hist,
            num_pairs,
            chunk,
            num_global,
            num_experts,
            HAS_MAP=expert_map is not None,
            BLOCK_P=block_p,
            E_POW2=e_pow2,
            num_warps=4,
            **pdl,
        )
    launch(
        _route_kernel,
        (num_chunks,),
        ids,
        emap,
        hist if counted else ints,
        sorted_pairs,
        counts,
        offsets,
        cursor,
        tile_expert,
        tile_row,
        tile_row_end,
        num_tiles,
        num_pairs,
        chunk,
        num_chunks,
        num_global,
        num_experts,
        n_tiles,
        COUNTED=counted,
        MAX_CHUNKS=_route_max_chunks(e_pow2),
        HAS_MAP=expert_map is not None,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        E_POW2=e_pow2,
        num_warps=8,
        **pdl,
    )
    return sorted_pairs, counts, offsets, tile_expert, tile_row, tile_row_end, num_tiles


# The row count changes with the batch: not specialized on, so a new max_tokens never compiles a new variant.
@triton.jit(do_not_specialize=["max_tokens", "num_rows", "max_tiles"])
def _batched_route_kernel(
    counts_in_ptr,
    sorted_rows_ptr,
    counts_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_row_end_ptr,
    num_tiles_ptr,
    max_tokens,
    num_rows,
    num_experts,
    max_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    E_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    """The batched format's plan (routing.plan_batched_routing): program c writes rows c * BLOCK_ROWS .. of the
    identity row list (each row is its own pair); program 0 also writes the clamped counts, the offsets
    (e * max_tokens) and the tile map, each expert's tiles starting at its first row e * max_tokens."""
    _after_previous_kernel(PDL)
    c = tl.program_id(0)
    rows = c * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tl.store(sorted_rows_ptr + rows, rows, mask=rows < num_rows)
    if c == 0:
        experts = tl.arange(0, E_POW2)
        expert_ok = experts < num_experts
        counts = tl.load(counts_in_ptr + experts, mask=expert_ok, other=0).to(tl.int32)
        counts = tl.minimum(tl.maximum(counts, 0), max_tokens)  # a corrupt count stays inside its expert's rows
        starts = experts * max_tokens
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)
        first_tile = tile_ends - tiles
        tl.store(counts_ptr + experts, counts, mask=expert_ok)
        tl.store(offsets_ptr + experts, starts, mask=expert_ok)
        tl.store(offsets_ptr + num_experts, num_experts * max_tokens)
        tl.store(num_tiles_ptr, tl.sum(tiles, 0))
        for j in range(0, tl.max(tiles, 0)):
            owned = expert_ok & (j < tiles)
            tl.store(tile_expert_ptr + first_tile + j, experts, mask=owned)
            tl.store(tile_row_ptr + first_tile + j, starts + j * BLOCK_M, mask=owned)
            tl.store(tile_row_end_ptr + first_tile + j, starts + tl.minimum((j + 1) * BLOCK_M, counts), mask=owned)
        for t0 in range(tl.sum(tiles, 0), max_tiles, BLOCK_ROWS):
            t = t0 + tl.arange(0, BLOCK_ROWS)
            tl.store(tile_expert_ptr + t, tl.full([BLOCK_ROWS], -1, tl.int32), mask=t < max_tiles)
            tl.store(tile_row_ptr + t, tl.zeros([BLOCK_ROWS], tl.int32), mask=t < max_tiles)
            tl.store(tile_row_end_ptr + t, tl.zeros([BLOCK_ROWS], tl.int32), mask=t < max_tiles)


BATCHED_ROUTE_ROWS = 4096  # identity rows a program of _batched_route_kernel writes


def route_batched(expert_num_tokens: torch.Tensor, max_tokens: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """One launch of _batched_route_kernel for the batched layout [E, max_tokens, H] and its per-expert counts
    (int32 [E], any values: clamped to [0, max_tokens]); returns route()'s tuple (sorted_pairs: the flat rows, counts,
    offsets, tile_expert, tile_row, tile_row_end, num_tiles) as routing.plan_batched_routing computes it.  The
    grid and every buffer are sized from E and max_tokens only."""
    from ..routing import batched_max_tiles

    num_experts = expert_num_tokens.numel()
    num_rows = num_experts * max_tokens
    n_tiles = batched_max_tiles(num_experts, max_tokens, block_m)
    sizes = (num_rows, num_experts, num_experts + 1, n_tiles, n_tiles, n_tiles, 1)
    starts = [0]
    for size in sizes:  # each part on a 16-byte boundary, as route()'s buffers (no recompilation per shape)
        starts.append(starts[-1] + round_up(size, 4))
    ints = torch.empty(starts[-1], dtype=torch.int32, device=expert_num_tokens.device)
    parts = tuple(ints[start : start + size] for start, size in zip(starts, sizes))
    e_pow2 = next_pow2(num_experts)
    launch(
        _batched_route_kernel,
        (max(1, -(-num_rows // BATCHED_ROUTE_ROWS)),),
        expert_num_tokens,
        *parts,
        max_tokens,
        num_rows,
        num_experts,
        n_tiles,
        BLOCK_M=block_m,
        BLOCK_ROWS=BATCHED_ROUTE_ROWS,
        E_POW2=e_pow2,
        num_warps=8,
        **common._dependent_launch(expert_num_tokens.device),
    )
    return parts
