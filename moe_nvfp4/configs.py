"""Kernel configurations: frozen dataclasses with one ``is_valid``, a default model, tuned and measured entries.

A config is chosen per call by ``select_config(tokens, LayerShape, DeviceTraits)``, from (first that has
entries for the shape):
1. entries an autotuner measured in this process (``register_entries``; ``moe_nvfp4.autotune``);
2. the tuned file that serves the device (``tuned_file_for``: ``configs/fused_moe_sm90/<device name>.json``, else
   a file tuned on a part of the same capability and SM count):
     {"meta": {"kernel": "fused_moe_sm90", "version": 3, "device": "NVIDIA H200", "capability": [9, 0],
               "sm_count": 132, "memory_gib": 140, ...},
      "entries": [{"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16",
                   "max_tokens": 16, "config": {...MoEKernelConfig fields...}}, ...]}
   (``global_experts`` in an entry: the routing's expert count under expert parallelism; absent, ``experts``);
3. ``default_config``, a deterministic model of the problem and the device.
An entry serves token counts up to ``max_tokens`` (the smallest such entry wins; past the largest, the largest).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch

from .layouts import FragmentLayout, round_up

__all__ = [
    "GemmConfig",
    "MoEKernelConfig",
    "CONFIG_VERSION",
    "DeviceTraits",
    "LayerShape",
    "default_config",
    "device_traits",
    "load_config_file",
    "select_config",
    "serving_entry",
    "configs_up_to",
    "entries_for",
    "register_entries",
    "tuned_file_for",
]

# 2: FragmentLayout kernel (block_n in 64-row units, no join_halves); 3: no tile group, K split or stream-K fields
CONFIG_VERSION = 3
KERNEL_NAME = "fused_moe_sm90"
CONFIG_DIR = Path(os.environ.get("MOE_NVFP4_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))
CHUNK_K = FragmentLayout().chunk_k  # the kernel's K step (128), fixed by the weight layout
# sm_90's shared memory per block (227 KiB), less room for the warp-specialized kernel's barriers and padding
WS_SMEM_LIMIT = 227 * 1024 - 1024
SM_REGISTERS = 65536  # sm_90's registers per SM (and per block)
# Token tiles (MoEKernelConfig.block_m) the kernels run; 8 only where both GEMMs are Gluon (design 002 decision 20).
TOKEN_TILES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's launch parameters (the weight tile is BLOCK_N rows x 128 K per step).

    max_registers caps the registers per thread (ptxas ``.maxnreg``; None: the compiler's choice).  The
    decode GEMMs are issue-bound with few warps per scheduler, and registers bound how many programs fit on
    an SM: a GEMM1 tile of 128 rows takes 236 registers, two programs of 4 warps, whatever programs_per_sm
    asks for.  Capped at 168 three fit, at 128 four (ptxas then waits on each wgmma instead of spilling).

    warp_specialized: run the GEMM as the Gluon kernel (triton.moe_sm90_ws): a TMA loader warp group and 4 or 8 MMA
    warps, whole K per tile.  max_registers then sets residency (uncapped one program per SM, 128 two, 80
    three: the loader's warp group counts too).  chunks_per_stage (warp-specialized only): K chunks of 128 per
    stage of its ring, fetched as one TMA box per matrix; the MMA warps keep MMAs running while they decode
    the stage's next matrix (one at 128 rows per warp group, two at 64) and retire them all at its end.

    k_groups (warp-specialized only; 1 or 2): MMA warp groups of num_warps warps that share each tile, group g
    taking its K steps g, g + k_groups, ... (each tile's steps padded to a multiple of k_groups); group 0 adds
    group 1's sums from shared memory, in the same order wherever the tile runs, so a row's bits do not
    depend on which tile it lands in.  More warps decode one tile where tiles are fewer than the SMs' program
    slots (Qwen3 GEMM1 at T=1: 96 tiles), and a program's loader warp group serves both MMA groups.
    max_registers must let one program (k_groups x num_warps MMA warps and the loader's warp group) fit an SM's
    65536 registers, and num_stages be a multiple of k_groups (each stage then always serves the same group).
    Three and four groups are gone: no tuned config chose them.

    narrow_tiles (0, 1 or 2): a tile whose rows fit in block_m / 2 (or / 4) runs its MMAs that narrow, down to 8
    tokens in the warp-specialized kernel and 16 in the Triton one (the weights are the MMA's 64-row side, the
    tokens its N).  At decode a tile then fits the largest expert, so no expert's weights stream twice, while the
    many smaller ones pay for MMAs of their own width only (Mixtral T=1, GEMM1 at block_m 16: 43.8 -> 41.1 us on
    the H200).  At prefill an expert's last tile often holds a few rows (Qwen3 T=1024: about 64 tokens an expert,
    so half the experts have a second 64-row tile of 1-30 rows); their narrower MMAs gained 2% in that GEMM2 and
    lost elsewhere, the extra K loops costing more than they save (design 002).

    loader_warps (warp-specialized only; 1, 2 or 4): the loader warp group's warps that issue the token rows'
    cp.async (one thread issues the TMA boxes).  A thread holds block_m / (2 x loader_warps) row addresses:
    one warp spills them from block_m 16 on, while at block_m 8 four warps waiting on every stage cost
    Mixtral's long-K GEMM2 9 us of 78 (H200).

    Every GEMM takes whole K per tile, its tiles in the kernels' fixed grouped order (sm90_common._grouped_tile).
    Config version 3 removed the fields of modes no tuned or default config chose: the tile group (always 8, now
    the fixed order), K splits (fp32 partials) and stream-K (equal runs of K steps per program)."""

    block_n: int = 64
    num_stages: int = 4
    num_warps: int = 4
    programs_per_sm: int = 1
    max_registers: int | None = None
    warp_specialized: bool = False
    chunks_per_stage: int = 1
    k_groups: int = 1
    narrow_tiles: int = 0
    loader_warps: int = 4

    def is_valid(self, k_padded: int) -> bool:
        chunks = k_padded // CHUNK_K
        return (
            self.block_n in (64, 128, 256)  # whole 64-row units of the layout
            and 1 <= self.num_stages <= 8
            and self.num_warps in (1, 2, 4, 8, 16)
            and (not self.warp_specialized or self._warp_specialized_ok())
            and self.chunks_per_stage in ((1, 2, 4) if self.warp_specialized else (1,))
            and (self.k_groups == 1 or (self.warp_specialized and self._k_groups_fit()))
            and self.narrow_tiles in (0, 1, 2)
            and self.loader_warps in ((1, 2, 4) if self.warp_specialized else (4,))
            and chunks % self.chunks_per_stage == 0
            and 1 <= self.programs_per_sm <= 8
            and (self.max_registers is None or (64 <= self.max_registers <= 255 and self.max_registers % 8 == 0))
        )

    @property
    def narrowest_mma(self) -> int:
        """The fewest tokens an MMA of this GEMM may be wide (wgmma's N): 8 in the Gluon kernel; Triton lowers an
        8-wide tl.dot to mma.sync, so 16 there."""
        return 8 if self.warp_specialized else 16

    def _warp_specialized_ok(self) -> bool:
        # one or two MMA warp groups of at least 64 rows each, a ring of two or more stages
        return self.num_warps in (4, 8) and self.block_n >= 16 * self.num_warps and self.num_stages >= 2

    def _k_groups_fit(self) -> bool:
        mma_warps = self.num_warps * self.k_groups
        return (
            self.k_groups == 2
            and self.num_stages % self.k_groups == 0
            and self.max_registers is not None
            and 32 * self.max_registers * (mma_warps + 4) <= SM_REGISTERS
        )

    def ws_shared_bytes(self, gated: bool, block_m: int) -> int:
        """Shared memory of the warp-specialized kernel: its ring (per stage and chunk, the token rows (16-bit)
        and each matrix's (``gated``: gate and up) 4 KiB of values and 512 bytes of scales per 64-row unit), and
        the float32 sums MMA group 1 hands to group 0 (a gate and an up tile when ``gated``)."""
        fragments = FragmentLayout()
        halves = 2 if gated else 1
        unit_bytes = fragments.block_bytes + fragments.scale_block_bytes
        per_chunk = block_m * CHUNK_K * 2 + halves * (self.block_n // fragments.unit_rows) * unit_bytes
        sums = (self.k_groups - 1) * halves * self.block_n * block_m * 4
        return self.num_stages * self.chunks_per_stage * per_chunk + sums

    def narrowed_for(self, block_m: int) -> "GemmConfig":
        """This GEMM with narrow_tiles lowered as far as ``block_m`` needs (its narrowest MMA stays narrowest_mma
        wide)."""
        narrow = self.narrow_tiles
        while narrow and block_m >> narrow < self.narrowest_mma:
            narrow -= 1
        return replace(self, narrow_tiles=narrow)

    def launch_options(self) -> dict:
        """Triton launch keywords: warps, and the register cap when there is one."""
        cap = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return {"num_warps": self.num_warps, **cap}


def _refuse_unknown_keys(d: dict, cls: type, where: str) -> None:
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}, not {cls.__name__} fields "
            f"(config version {CONFIG_VERSION})"
        )


@dataclass(frozen=True)
class MoEKernelConfig:
    """block_m (token rows per tile) is shared: both GEMMs read the same tile map.  A tile of 8 tokens (wgmma's
    narrowest N, for experts with a few tokens each) needs both GEMMs warp-specialized: Triton lowers an
    8-wide tl.dot to mma.sync, which made the Triton kernel slower, not faster (design 002).  partials_in_x_dtype:
    GEMM2 writes its rows per (token, k) in x's dtype instead of float32, halving what the combine moves
    (T * top_k * H values) for one more rounding per row, as vLLM's BF16 MoE does.  pair_tiles: every (token, k)
    pair is a token tile of its own, its expert read from topk_ids, so no routing kernel runs (one launch and its
    latency less).  A pair then streams its expert's weights alone: meant for one token, whose k pairs hit k
    distinct experts, and wasteful where pairs share experts.  It needs both GEMMs warp-specialized (the Triton
    kernel reads the routing kernel's map); where the Gluon kernel cannot run (rows not 16-byte aligned), the
    forward routes as usual.  Under an expert map the Gluon GEMMs map each pair's expert themselves and skip the
    pairs of other ranks."""

    block_m: int = 16
    gemm1: GemmConfig = field(default_factory=GemmConfig)
    gemm2: GemmConfig = field(default_factory=GemmConfig)
    partials_in_x_dtype: bool = False
    pair_tiles: bool = False

    def is_valid(self, hidden_padded: int, intermediate_padded: int, gated: bool = True) -> bool:
        """``gated``: GEMM1 streams gate and up rows (two matrices in the Gluon kernel's ring), else one."""
        return (
            (
                self.block_m in TOKEN_TILES
                and (self.block_m > 8 or (self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            )
            and all(self.block_m >> g.narrow_tiles >= g.narrowest_mma for g in (self.gemm1, self.gemm2))
            and self.gemm1.is_valid(hidden_padded)
            and self.gemm2.is_valid(intermediate_padded)
            and not (self.pair_tiles and not (self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            and all(
                not g.warp_specialized or g.ws_shared_bytes(two, self.block_m) <= WS_SMEM_LIMIT
                for g, two in ((self.gemm1, gated), (self.gemm2, False))
            )
        )

    @classmethod
    def from_dict(cls, d: dict) -> "MoEKernelConfig":
        # block_m, gemm1 and gemm2 are required; fields added later are optional (older files get the defaults).
        # A key that is no field is refused, not dropped: a removed mode (version 2's K split, stream-K, tile group)
        # must not run silently as something else.
        _refuse_unknown_keys(d, cls, "config")
        for gemm in ("gemm1", "gemm2"):
            _refuse_unknown_keys(d.get(gemm, {}), GemmConfig, gemm)
        later = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("block_m", "gemm1", "gemm2")}
        return cls(block_m=d["block_m"], gemm1=GemmConfig(**d["gemm1"]), gemm2=GemmConfig(**d["gemm2"]), **later)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_token_tile(self, block_m: int) -> "MoEKernelConfig":
        """This config at token tile ``block_m``, each GEMM's narrow_tiles lowered as far as the new tile needs (its
        narrowest MMA must stay GemmConfig.narrowest_mma wide), so a move from 32-token tiles with narrow_tiles 2
        to 16 is not refused for 4-wide MMAs alone."""
        return replace(
            self, block_m=block_m, gemm1=self.gemm1.narrowed_for(block_m), gemm2=self.gemm2.narrowed_for(block_m)
        )


def _pad(k: int) -> int:
    return round_up(k, CHUNK_K)


@dataclass(frozen=True)
class DeviceTraits:
    """What a config depends on in the device: the name tuned files are keyed by, the compute capability, and
    the SM count (persistent grids and the default's tile counts scale with it).  ``device_traits`` reads them."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_gib: int = 0  # tells HBM3 parts from HBM3e ones of the same SM count, for tuned_file_for


# The Triton interpreter (CPU tensors): two programs, so persistent loops still stride.
CPU_TRAITS = DeviceTraits("cpu", (0, 0), 2)
# default_config's device when none is given: a Hopper part with 132 SMs (H100 SXM, H200, H800, GH200).
HOPPER_132 = DeviceTraits("sm_90 with 132 SMs", (9, 0), 132)


@lru_cache(maxsize=None)
def _cuda_traits(index: int) -> DeviceTraits:
    props = torch.cuda.get_device_properties(index)
    return DeviceTraits(
        props.name, (props.major, props.minor), props.multi_processor_count, round(props.total_memory / 2**30)
    )


def device_traits(device: torch.device) -> DeviceTraits:
    """The traits of ``device`` (read once per GPU); CPU_TRAITS for CPU tensors."""
    if device.type != "cuda":
        return CPU_TRAITS
    return _cuda_traits(torch.cuda.current_device() if device.index is None else device.index)


@dataclass(frozen=True)
class LayerShape:
    """What a MoE layer's configs are chosen for: local experts, top-k, H, I, activation dtype, the routing's
    expert count (``global_experts``: the expert map's length under expert parallelism, else ``experts``) and
    whether GEMM1 is gated (2I rows: gate and up) or not (I rows; expert_activation)."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"
    global_experts: int = 0  # 0: as many as ``experts``
    gated: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: stored by name, as tuned files spell it
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not self.global_experts:
            object.__setattr__(self, "global_experts", self.experts)

    @property
    def padded_k(self) -> tuple[int, int]:
        """GEMM1's and GEMM2's K (H and I) padded to whole 128-wide chunks, as the packed layout stores them."""
        return _pad(self.hidden), _pad(self.intermediate)

    def accepts(self, cfg: "MoEKernelConfig") -> bool:
        """Whether ``cfg`` is valid for this shape's padded K dimensions."""
        return cfg.is_valid(*self.padded_k, self.gated)

    @property
    def entry_key(self) -> tuple:
        """The fields a tuned entry is matched on."""
        return self.experts, self.global_experts, self.top_k, self.hidden, self.intermediate, self.dtype, self.gated

    def rows_per_active_expert(self, tokens: int) -> float:
        """Expected (token, k) pairs per expert that gets any, with uniform routing: T k / (E (1 - (1 - k/E)^T))
        over the routing's E experts (the local share of both numerator and denominator cancels).  1 at one
        token; rises to T k / E once every expert is busy."""
        e, k = self.global_experts, min(self.top_k, self.global_experts)
        return tokens * k / (e * -math.expm1(tokens * math.log1p(-k / e))) if k < e else float(tokens)

    def busy_experts(self, tokens: int) -> float:
        """Expected local experts that get any (token, k) pair, with uniform routing: E (1 - (1 - k/E_g)^T)."""
        e, k = self.global_experts, min(self.top_k, self.global_experts)
        return self.experts * (1.0 if k == e else -math.expm1(tokens * math.log1p(-k / e)))

    def decode_tiles(self, tokens: int, n: int, block_m: int, block_n: int) -> float:
        """Expected output tiles of a GEMM with N = ``n`` at ``tokens`` (busy experts x token tiles x N tiles)."""
        return self.busy_experts(tokens) * math.ceil(self.rows_per_active_expert(tokens) / block_m) * -(-n // block_n)

    def tokens_up_to_rows(self, rows: float) -> int:
        """The largest T whose rows_per_active_expert is at most ``rows`` (the function rises with T)."""
        return _last_tokens_where(lambda t: self.rows_per_active_expert(t) <= rows)


def _last_tokens_where(holds: Callable[[int], bool]) -> int:
    """The largest T >= 1 for which ``holds`` (true up to some T, false from there on; 1 if it never holds)."""
    lo, hi = 1, 1
    while holds(hi * 2):
        hi *= 2
    hi *= 2
    while hi - lo > 1:  # holds(lo) or lo = 1; not holds(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


# ---- the default: one readable model of what the tuned entries chose, keyed by the problem and the device ----
# Token tile per expected rows per busy expert (the first bound that holds): a tile fits a busy expert's rows
# with room for the routing's spread, and the Gluon kernel runs 8-wide MMAs at decode.
TILE_BY_ROWS = ((5, 8), (10, 16), (20, 32), (96, 64))
# Narrow MMAs in 64-token tiles (an expert's rows then often fill a quarter or half of the tile).
NARROW_64_BY_ROWS = ((32, 2), (48, 1))
PAIR_TILE_TOKENS = 2  # up to this many tokens every pair is a tile of its own (no routing launch)
PARTIALS_IN_X_ROWS = 48  # past these rows per busy expert GEMM2 writes x's dtype (top-k > 2 always does)
SHORT_K_ROWS = 32  # past these rows, 64-token tiles run GEMM2 on the Triton kernel where its K is short
SHORT_K2 = 2048  # GEMM2's K (= I) under which that holds
LONG_K2 = 8192  # 128-token tiles keep GEMM2 on the Gluon kernel from this K (long K hides its pipeline fill)
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
    * 64-token tiles (m <= 96): the Gluon kernel with two MMA warp groups; GEMM2 on the Triton kernel where its K
      is short and the experts are busy (the Gluon kernel's per-tile pipeline fill then shows).
    * Prefill (128-token tiles): the Triton kernel, GEMM2 warp-specialized where its K is long.
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
    # the pairs this rank expects: under expert parallelism E/E_g of the T k (DBRX EP8 at one token: half a pair)
    block_m, pairs = 8, max(tokens, 1) * shape.top_k * shape.experts / shape.global_experts

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
        long_k = shape.intermediate >= LONG_K2
        gemm2_preset = dict(WS_TWO_GROUPS, num_stages=2, max_registers=None) if long_k else TRITON_PREFILL
        gemm2 = fit_gemm(gemm2_preset, k2, block_m, False)
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
    (DEFAULT_ROW_BOUNDS), and the last T under each SM-count bound on 8-token tiles (_decode_preset)."""
    # 8-token tiles' deep ring (64-row tiles), and _fill_the_sms' 128-row tiles at each token tile it decides
    under_sms = [
        lambda t, n=n, m=m, rows=rows: shape.decode_tiles(t, n, m, rows) < device.sm_count
        for n in (shape.intermediate, shape.hidden)
        for m, rows in ((8, 64), (8, 128), (16, 128), (32, 128))
    ]
    return sorted(
        set(range(1, PAIR_TILE_TOKENS + 1))
        | {shape.tokens_up_to_rows(b) for b in DEFAULT_ROW_BOUNDS}
        | {_last_tokens_where(holds) for holds in under_sms}
    )


@lru_cache(maxsize=None)
def load_config_file(path: str) -> tuple[dict, tuple[dict, ...]]:
    """Read and check one tuned file; returns (meta, entries).  Raises ValueError on a bad file."""
    data = json.loads(Path(path).read_text())
    meta = data.get("meta", {})
    if meta.get("kernel") != KERNEL_NAME or meta.get("version") != CONFIG_VERSION:
        raise ValueError(f"{path}: expected meta kernel={KERNEL_NAME!r} version={CONFIG_VERSION}, got {meta}")
    entries = tuple(data.get("entries", ()))
    for i, entry in enumerate(entries):
        for key in ("experts", "top_k", "hidden", "intermediate", "dtype", "max_tokens", "config"):
            if key not in entry:
                raise ValueError(f"{path}: entry {i} lacks {key!r}")
        cfg = MoEKernelConfig.from_dict(entry["config"])
        if not cfg.is_valid(_pad(entry["hidden"]), _pad(entry["intermediate"]), entry.get("gated", True)):
            raise ValueError(f"{path}: entry {i} has an invalid config {cfg}")
    return meta, entries


def config_path(device_name: str, config_dir: Path | None = None) -> Path:
    """Where a device's tuned configs live under ``config_dir`` (default CONFIG_DIR, read at the call:
    MOE_NVFP4_CONFIG_DIR or the shipped configs/)."""
    return (CONFIG_DIR if config_dir is None else config_dir) / KERNEL_NAME / (device_name.replace(" ", "_") + ".json")


def tuned_file_for(device: DeviceTraits, config_dir: Path | None = None) -> Path | None:
    """The tuned file that serves ``device``: its own (by name), else one tuned on a part of the same
    compute capability and SM count (the files' meta records both; an H100 NVL or a GH200 has no file of its
    own), the one whose memory size is nearest (HBM3 against HBM3e); None if there is none."""
    own = config_path(device.name, config_dir)
    if own.exists():
        return own
    same = []
    for path in sorted(own.parent.glob("*.json")):
        meta = load_config_file(str(path))[0]
        if tuple(meta.get("capability", ())) == device.capability and meta.get("sm_count") == device.sm_count:
            same.append((abs(meta.get("memory_gib", 0) - device.memory_gib), path))
    return min(same)[1] if same else None


# Entries an autotuner measured in this process (autotune.autotune_fused_moe), by device name and shape
# (LayerShape.entry_key): they serve their shape before any file's entries.
_MEASURED: dict[str, dict[tuple, list[dict]]] = {}


def register_entries(device: DeviceTraits, entries: Sequence[dict]) -> None:
    """Serve ``entries`` (dicts as in a tuned file) on ``device`` from now on in this process, ahead of the tuned
    file's entries for the same shapes; an entry with the same shape and max_tokens as an earlier one replaces it.
    Every entry is checked before any is kept."""
    for entry in entries:
        cfg = MoEKernelConfig.from_dict(entry["config"])
        if not entry_shape(entry).accepts(cfg):
            raise ValueError(
                f"entry for {entry_shape(entry)} up to {entry['max_tokens']} tokens has an invalid config {cfg}"
            )
    table = _MEASURED.setdefault(device.name, {})
    for entry in entries:
        key = entry_shape(entry).entry_key
        table[key] = [e for e in table.get(key, []) if e["max_tokens"] != entry["max_tokens"]] + [entry]


def entry_shape(entry: dict) -> LayerShape:
    """The layer shape a tuned entry is for (``global_experts`` defaults to ``experts``: no expert parallelism;
    ``gated`` to True)."""
    return LayerShape(
        entry["experts"],
        entry["top_k"],
        entry["hidden"],
        entry["intermediate"],
        entry["dtype"],
        entry.get("global_experts", 0),
        entry.get("gated", True),
    )


def measured_entries(shape: LayerShape, device: DeviceTraits) -> list[dict]:
    """The entries registered for ``shape`` on ``device`` in this process (register_entries)."""
    return _MEASURED.get(device.name, {}).get(shape.entry_key, [])


def entries_for(shape: LayerShape, device: DeviceTraits) -> list[dict]:
    """The entries that serve ``shape`` on ``device``: measured in this process if any, else the tuned file's."""
    return measured_entries(shape, device) or _tuned_entries(device).get(shape.entry_key, [])


def select_config(tokens: int, shape: LayerShape, device: DeviceTraits) -> MoEKernelConfig:
    """The config for ``tokens`` of ``shape`` on ``device``: of its entries (entries_for), the one with the
    smallest max_tokens >= tokens (past every entry, the largest); without entries, default_config."""
    entries = entries_for(shape, device)
    if entries:
        return MoEKernelConfig.from_dict(serving_entry(entries, tokens)["config"])
    return default_config(
        tokens,
        shape.experts,
        shape.top_k,
        shape.hidden,
        shape.intermediate,
        global_experts=shape.global_experts,
        device=device,
        gated=shape.gated,
    )


def serving_entry(entries: Sequence[dict], tokens: int) -> dict:
    """Of one shape's tuned entries (not empty), the one that serves ``tokens``: the smallest max_tokens >= tokens,
    past every entry the largest."""
    fits = [e for e in entries if e["max_tokens"] >= tokens]
    return min(fits, key=lambda e: e["max_tokens"]) if fits else max(entries, key=lambda e: e["max_tokens"])


def configs_up_to(max_tokens: int, shape: LayerShape, device: DeviceTraits) -> dict[MoEKernelConfig, int]:
    """Every config ``select_config`` picks for 1..max_tokens tokens, each with the fewest tokens that pick it.

    select_config is constant between the token counts where an entry or a default_config bound ends, so
    checking 1 and each count just past such an end finds every config (what a warm-up must compile).
    """
    entries = entries_for(shape, device)
    ends = [e["max_tokens"] for e in entries] if entries else default_bounds(shape, device)
    found: dict[MoEKernelConfig, int] = {}
    for tokens in sorted({1} | {end + 1 for end in ends if 0 < end < max_tokens}):
        found.setdefault(select_config(tokens, shape, device), tokens)
    return found


@lru_cache(maxsize=None)
def _tuned_entries(device: DeviceTraits) -> dict[tuple, list[dict]]:
    """The entries of the file that serves ``device`` (tuned_file_for) by shape, read once per process
    (select_config runs on every forward)."""
    path = tuned_file_for(device)
    by_shape: dict[tuple, list[dict]] = {}
    for entry in load_config_file(str(path))[1] if path is not None else ():
        by_shape.setdefault(entry_shape(entry).entry_key, []).append(entry)
    return by_shape
