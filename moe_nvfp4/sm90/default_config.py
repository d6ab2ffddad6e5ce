"""The sm_90 MoE's default config: one readable, deterministic model of what the tuned entries chose, keyed by
the problem (``shapes.LayerShape``) and the device (``shapes.DeviceTraits``), so a shape nobody tuned runs well
(``default_config``), and the token counts where its choice may change (``default_bounds``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Sequence

from ..shapes import DeviceTraits, LayerShape, last_tokens_where
from .configs import CHUNK_K, WS_SMEM_LIMIT, GemmConfig, MoEKernelConfig

__all__ = ["HOPPER_132", "default_bounds", "default_config", "fit_gemm"]

# default_config's device when none is given: a Hopper part with 132 SMs (H100 SXM, H200, H800, GH200).
HOPPER_132 = DeviceTraits("sm_90 with 132 SMs", (9, 0), 132)

# Token tile per expected rows per busy expert (the first bound that holds): a tile fits a busy expert's rows
# with room for the routing's spread, and the Gluon kernel runs 8-wide MMAs at decode.  Past 64 rows 128-token
# tiles: faster from 72 rows on 2 of 2 models, 80 on 11 of 11 (up to 1.27x), slower at 64 on 11 of 11 (design 004
# decision 13).
TILE_BY_ROWS = ((5, 8), (10, 16), (20, 32), (64, 64))
# Narrow MMAs in 64-token tiles (an expert's rows then often fill a quarter or half of the tile).
NARROW_64_BY_ROWS = ((32, 2), (48, 1))
PAIR_TILE_TOKENS = 2  # up to this many tokens every pair is a tile of its own (no routing launch)
PARTIALS_IN_X_ROWS = 48  # past these rows per busy expert GEMM2 writes x's dtype (top-k > 2 always does)
SHORT_K_ROWS = 32  # past these rows, 64-token tiles run GEMM2 on the Triton kernel where its K is short
SHORT_K2 = 2048  # GEMM2's K (= I) under which that holds
# Every bound on rows the default compares against (configs_up_to finds the token counts where it changes).
DEFAULT_ROW_BOUNDS = tuple(
    sorted({b for b, _ in TILE_BY_ROWS} | {b for b, _ in NARROW_64_BY_ROWS} | {PARTIALS_IN_X_ROWS, SHORT_K_ROWS})
)

# Launch presets (GemmConfig fields) of the kernel families the tuned entries use.  ws: the warp-specialized
# Gluon kernel (4 MMA warps + the loader's warp group: capped at 128 registers two programs fit an SM; 8 MMA
# warps at 168 one does).
WS_DECODE = dict(
    warp_specialized=True,
    block_n=64,
    num_warps=4,
    num_stages=2,
    chunks_per_stage=2,
    programs_per_sm=2,
    max_registers=128,
)
WS_DECODE_WIDE = dict(WS_DECODE, block_n=128, num_stages=4, chunks_per_stage=1)
WS_ONE_GROUP = dict(WS_DECODE, block_n=128)
WS_TWO_GROUPS = dict(WS_DECODE, block_n=128, num_warps=8, num_stages=3, programs_per_sm=1, max_registers=168)
# At one or two tokens, a GEMM whose tiles cannot fill the SMs splits each tile's K over two MMA warp groups.
WS_K_GROUPS = dict(WS_DECODE, num_stages=4, programs_per_sm=1, max_registers=168, k_groups=2)
# 8-token tiles that cannot fill the SMs: one program per SM with a deeper ring (more loads in flight per busy SM).
WS_DECODE_DEEP = dict(WS_DECODE, num_stages=3, programs_per_sm=1, max_registers=168)
TRITON_PREFILL = dict(block_n=128, num_warps=8, num_stages=3, programs_per_sm=2)
# GEMM2 of 128-token tiles reads TMA boxes (gemm_triton), which fits two programs an SM in 128 registers with a
# two-stage ring and no spill: 1.10-1.18x (median 1.13x) the three uncapped stages on addresses, 20 zoo prefill
# cases; at 64-token tiles two stages lost 3-4%, so those keep three (design 002 decision 25, 2026-11-30).  Long
# K (I >= 8192) too: 1.01-1.05x the Gluon kernel (design 002 decision 26).
TRITON_PREFILL_GEMM2 = dict(TRITON_PREFILL, num_stages=2, max_registers=128)
# GEMM2 (N = H, K = I) of routed 8-token tiles takes 128-row tiles: half the tiles, each reading its few
# activation rows once for twice the weights (0.6-9% faster, median 3.7%, on 26 zoo cases at 4-64 tokens, none
# slower; design 004).  Its 64-row units still decide the deep ring (_decode_preset), as when that was measured.
DECODE_GEMM2_BLOCK_N = 128


def _first(bounds: Sequence[tuple[float, int]], rows: float, past: int) -> int:
    return next((value for bound, value in bounds if rows <= bound), past)


def fit_gemm(preset: dict, k_padded: int, block_m: int, gated: bool, **fields) -> GemmConfig:
    """``preset`` made valid for this GEMM: its chunks per stage divide K's chunks (fewer chunks, more stages:
    the same ring), then stages drop until the ring fits shared memory (the Gluon kernel)."""
    g = GemmConfig(**{**preset, **fields})
    chunks = k_padded // CHUNK_K
    while chunks % g.chunks_per_stage:
        g = replace(g, chunks_per_stage=g.chunks_per_stage // 2, num_stages=g.num_stages * 2)
    while g.warp_specialized and g.num_stages > 2 and g.ws_shared_bytes(gated, block_m) > WS_SMEM_LIMIT:
        g = replace(g, num_stages=g.num_stages - g.k_groups)
    return g


@lru_cache(maxsize=4096)  # select_config asks on every forward of a shape without entries
def default_config(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    *,
    global_experts: int = 0,
    device: DeviceTraits = HOPPER_132,
    gated: bool = True,
) -> MoEKernelConfig:
    """The config for a layer with no tuned entry: a deterministic model of what the tuned entries chose, from the
    expected rows per busy expert ``m`` (LayerShape.rows_per_active_expert) and the SM count.

    * One or two tokens: pair tiles (no routing launch), 8-token tiles, both GEMMs warp-specialized; a GEMM whose
      pairs x N / 64 tiles cannot fill the SMs splits each tile's K over two MMA warp groups, one with 64-row tiles
      for every SM twice over takes 128-row ones.  Pairs are the rank's expected ones, T k E/E_g (design 004
      decision 9).
    * Decode (tiles of 8-32 tokens, m <= 20): both GEMMs warp-specialized, 8-wide MMAs in 8-token tiles, half-width
      ones in 16- and 32-token tiles.
    * 64-token tiles (m <= 64): the Gluon kernel with two MMA warp groups; GEMM2 on the Triton kernel where its K
      is short and the experts are busy (the Gluon kernel's per-tile pipeline fill then shows).
    * Prefill (128-token tiles): the Triton kernel, GEMM2 on TMA boxes two programs an SM.
    GEMM2 writes x's dtype for the combine where top-k > 2 or m > 48 (half the combine's bytes).
    A non-gated GEMM1 (``gated`` False: one matrix of I rows) gets the same tiles; its ring fits shared memory as one
    matrix's (fit_gemm).
    """
    shape = LayerShape(experts, top_k, hidden, intermediate, global_experts=global_experts, gated=gated)
    if tokens <= PAIR_TILE_TOKENS:
        cfg = _pair_tiles_config(shape, tokens, device)
    else:
        cfg = _routed_config(shape, tokens, device)
    if not cfg.is_valid(*shape.padded_k, gated):
        raise AssertionError(f"default_config produced an invalid config {cfg}")  # a bug, not user input
    return cfg


def _pair_tiles_config(shape: LayerShape, tokens: int, device: DeviceTraits) -> MoEKernelConfig:
    """default_config at one or two tokens: 8-token tiles, each pair a tile where no expert map routes them."""
    k1, k2 = shape.padded_k
    block_m, pairs = 8, shape.local_pairs(max(tokens, 1))  # under expert parallelism E/E_g of the T k

    def pair_gemm(n: int, k: int, two: bool) -> GemmConfig:
        units = pairs * -(-n // 64)  # tiles of 64 rows
        preset = WS_K_GROUPS if units < device.sm_count else WS_ONE_GROUP if units >= 2 * device.sm_count else WS_DECODE
        return fit_gemm(preset, k, block_m, two, loader_warps=2)

    # Under expert parallelism the presets run on routed 8-row tiles: pair tiles through the expert map were
    # slower where one or two of the pairs are local (design 004 decision 7), though the kernel runs them (an
    # explicit config).
    return MoEKernelConfig(
        block_m,
        pair_gemm(shape.intermediate, k1, shape.gated),
        pair_gemm(shape.hidden, k2, False),
        partials_in_x_dtype=shape.top_k > 2,
        pair_tiles=shape.global_experts == shape.experts,
    )


def _routed_config(shape: LayerShape, tokens: int, device: DeviceTraits) -> MoEKernelConfig:
    """default_config past two tokens: the token tile, kernel family and presets from the rows per busy expert."""
    rows = shape.rows_per_active_expert(tokens)
    (k1, k2), gated = shape.padded_k, shape.gated
    block_m = _first(TILE_BY_ROWS, rows, 128)
    narrow = {8: 0, 16: 1, 32: 1, 64: _first(NARROW_64_BY_ROWS, rows, 0), 128: 0}[block_m]
    i, h = shape.intermediate, shape.hidden
    if block_m == 8:
        gemm1 = fit_gemm(_decode_preset(shape, tokens, i, device), k1, 8, gated, loader_warps=2)
        gemm2_preset = dict(_decode_preset(shape, tokens, h, device), block_n=DECODE_GEMM2_BLOCK_N)
        gemm2 = fit_gemm(_fill_the_sms(gemm2_preset, shape, tokens, h, 8, device), k2, 8, False, loader_warps=2)
    elif block_m == 16:
        wide1, wide2 = (_fill_the_sms(WS_DECODE_WIDE, shape, tokens, n, 16, device) for n in (i, h))
        gemm1 = fit_gemm(wide1, k1, block_m, gated, narrow_tiles=narrow, loader_warps=4)
        gemm2 = fit_gemm(wide2, k2, block_m, False, narrow_tiles=narrow, loader_warps=4)
    elif block_m <= 64:
        gemm1 = fit_gemm(WS_TWO_GROUPS, k1, block_m, gated, narrow_tiles=narrow)
        if block_m == 32:
            gemm2 = fit_gemm(
                _fill_the_sms(WS_ONE_GROUP, shape, tokens, h, 32, device), k2, 32, False, narrow_tiles=narrow
            )
        elif rows <= SHORT_K_ROWS or shape.intermediate >= SHORT_K2:
            gemm2 = fit_gemm(WS_TWO_GROUPS, k2, block_m, False, narrow_tiles=narrow)
        else:
            gemm2 = fit_gemm(TRITON_PREFILL, k2, block_m, False, narrow_tiles=2, max_registers=128)
    else:
        gemm1 = fit_gemm(TRITON_PREFILL, k1, block_m, gated)
        gemm2 = fit_gemm(TRITON_PREFILL_GEMM2, k2, block_m, False)
    return MoEKernelConfig(block_m, gemm1, gemm2, partials_in_x_dtype=shape.top_k > 2 or rows > PARTIALS_IN_X_ROWS)


def _fill_the_sms(preset: dict, shape: LayerShape, tokens: int, n: int, block_m: int, device: DeviceTraits) -> dict:
    """64-row weight tiles for a GEMM of one MMA warp group whose expected 128-row tiles (N = ``n``) cannot fill the
    SMs: twice the tiles, so twice the SMs stream the weights, as on expert-parallel ranks of one or two experts.
    GEMMs of two MMA warp groups keep 128 rows (their one-group 64-row form was slower; design 004 decision 11)."""
    few = shape.decode_tiles(tokens, n, block_m, 128) < device.sm_count
    return dict(preset, block_n=64) if few and preset["block_n"] == 128 and preset["num_warps"] == 4 else preset


def _decode_preset(shape: LayerShape, tokens: int, n: int, device: DeviceTraits) -> dict:
    """The Gluon preset of an 8-token-tile GEMM with N = ``n`` (I for GEMM1's gate/up pairs, H for GEMM2): a
    deeper ring at one program per SM where its 64-row tiles cannot fill the SMs (what the autotuner chose on
    GLM-4.5 and Qwen3-235B at TP=8, 4 tokens: 16-20% faster; design 004)."""
    return WS_DECODE_DEEP if shape.decode_tiles(tokens, n, 8, 64) < device.sm_count else WS_DECODE


def default_bounds(shape: LayerShape, device: DeviceTraits) -> list[int]:
    """The token counts after which ``default_config`` may change for ``shape`` on ``device``: each count with
    pair tiles (their tiles follow the pairs), the last T under each bound on rows it compares
    (DEFAULT_ROW_BOUNDS), and the last T under each SM-count bound: 8-token tiles' 64-row tiles (_decode_preset)
    and the 128-row tiles of the 8-, 16- and 32-token tiles _fill_the_sms decides."""
    under_sms = [
        lambda t, n=n, m=m, rows=rows: shape.decode_tiles(t, n, m, rows) < device.sm_count
        for n in (shape.intermediate, shape.hidden)
        for m, rows in ((8, 64), (8, 128), (16, 128), (32, 128))
    ]
    return sorted(
        set(range(1, PAIR_TILE_TOKENS + 1))
        | {shape.tokens_up_to_rows(b) for b in DEFAULT_ROW_BOUNDS}
        | {last_tokens_where(holds) for holds in under_sms}
    )
