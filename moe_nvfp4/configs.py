"""Kernel configurations: frozen dataclasses with one ``is_valid``, a default heuristic, tuned JSON.

Tuned entries live in ``configs/fused_moe_sm90/<device>.json`` at the repository root:
  {"meta": {"kernel": "fused_moe_sm90", "version": 3, "device": "NVIDIA H200", ...},
   "entries": [{"experts": 128, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16",
                "max_tokens": 16, "config": {...MoEKernelConfig fields...}}, ...]}
An entry applies to token counts up to ``max_tokens`` (the smallest such entry wins; past the largest,
the largest entry's config, tuned for the most tokens, is kept).  The file's metadata is checked on load;
shapes with no entry use ``default_config``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from .layouts import FragmentLayout

__all__ = [
    "GemmConfig", "MoEKernelConfig", "CONFIG_VERSION", "default_config", "load_config_file", "select_config",
    "serving_entry", "configs_up_to", "config_device_name",
]

# 2: FragmentLayout kernel (block_n in 64-row units, no join_halves); 3: no tile group, K split or stream-K fields
CONFIG_VERSION = 3
KERNEL_NAME = "fused_moe_sm90"
CONFIG_DIR = Path(os.environ.get("MOE_NVFP4_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))
CHUNK_K = FragmentLayout().chunk_k  # the kernel's K step (128), fixed by the weight layout
# sm_90's shared memory per block (227 KiB), less room for the warp-specialized kernel's barriers and padding
WS_SMEM_LIMIT = 227 * 1024 - 1024
SM_REGISTERS = 65536  # sm_90's registers per SM (and per block)


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

    Every GEMM takes whole K per tile, its tiles in the kernels' fixed grouped order (moe_sm90._grouped_tile).
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
        return (self.k_groups == 2 and self.num_stages % self.k_groups == 0
                and self.max_registers is not None and 32 * self.max_registers * (mma_warps + 4) <= SM_REGISTERS)

    def ws_shared_bytes(self, gated: bool, block_m: int) -> int:
        """Shared memory of the warp-specialized kernel: its ring (per stage and chunk, the token rows (16-bit)
        and each matrix's (GATED: gate and up) 4 KiB of values and 512 bytes of scales per 64-row unit), and
        the float32 sums MMA group 1 hands to group 0 (a gate and an up tile when GATED)."""
        fragments = FragmentLayout()
        halves = 2 if gated else 1
        unit_bytes = fragments.block_bytes + fragments.scale_block_bytes
        per_chunk = block_m * CHUNK_K * 2 + halves * (self.block_n // fragments.unit_rows) * unit_bytes
        sums = (self.k_groups - 1) * halves * self.block_n * block_m * 4
        return self.num_stages * self.chunks_per_stage * per_chunk + sums

    def launch_options(self) -> dict:
        """Triton launch keywords: warps, and the register cap when there is one."""
        cap = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return {"num_warps": self.num_warps, **cap}


def _refuse_unknown_keys(d: dict, cls: type, where: str) -> None:
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}, not {cls.__name__} fields "
                         f"(config version {CONFIG_VERSION})")


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
    kernel reads the routing kernel's map); with an expert map, or where the Gluon kernel cannot run (rows not
    16-byte aligned), the forward routes as usual."""

    block_m: int = 16
    gemm1: GemmConfig = field(default_factory=GemmConfig)
    gemm2: GemmConfig = field(default_factory=GemmConfig)
    partials_in_x_dtype: bool = False
    pair_tiles: bool = False

    def is_valid(self, hidden_padded: int, intermediate_padded: int) -> bool:
        return (
            (self.block_m in (16, 32, 64, 128, 256)
             or (self.block_m == 8 and self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            and all(self.block_m >> g.narrow_tiles >= g.narrowest_mma for g in (self.gemm1, self.gemm2))
            and self.gemm1.is_valid(hidden_padded)
            and self.gemm2.is_valid(intermediate_padded)
            and not (self.pair_tiles and not (self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            and all(not g.warp_specialized or g.ws_shared_bytes(gated, self.block_m) <= WS_SMEM_LIMIT
                    for g, gated in ((self.gemm1, True), (self.gemm2, False)))
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


def _pad(k: int) -> int:
    return -(-k // CHUNK_K) * CHUNK_K


# default_config's token tile: the first block_m whose row bound holds the mean rows per expert, else 128.
DEFAULT_BLOCK_M = ((16, 16), (32, 32), (96, 64))


def default_config(tokens: int, experts: int, top_k: int, hidden: int, intermediate: int) -> MoEKernelConfig:
    """Readable heuristic: token tile from the mean rows per expert; small tiles for decode."""
    rows_per_expert = max(1, tokens * top_k // max(experts, 1))
    block_m = next((bm for bound, bm in DEFAULT_BLOCK_M if rows_per_expert <= bound), 128)
    big = block_m >= 64
    gemm1 = GemmConfig(block_n=128 if big else 64, num_warps=8 if big else 4, num_stages=3 if big else 4)
    gemm2 = GemmConfig(block_n=128 if big else 64, num_warps=8 if big else 4, num_stages=3 if big else 4)
    cfg = MoEKernelConfig(block_m=block_m, gemm1=gemm1, gemm2=gemm2)
    if not cfg.is_valid(_pad(hidden), _pad(intermediate)):
        raise AssertionError(f"default_config produced an invalid config {cfg}")  # a bug, not user input
    return cfg


@lru_cache(maxsize=None)
def load_config_file(path: str) -> tuple[dict, tuple[dict, ...]]:
    """Read and check one tuned file; returns (meta, entries).  Raises ValueError on a bad file."""
    data = json.loads(Path(path).read_text())
    meta = data.get("meta", {})
    if meta.get("kernel") != KERNEL_NAME or meta.get("version") != CONFIG_VERSION:
        raise ValueError(f"{path}: expected meta kernel={KERNEL_NAME!r} version={CONFIG_VERSION}, got {meta}")
    entries = tuple(data.get("entries", ()))
    for i, entry in enumerate(entries):
        for key in ("experts", "hidden", "intermediate", "dtype", "max_tokens", "config"):
            if key not in entry:
                raise ValueError(f"{path}: entry {i} lacks {key!r}")
        cfg = MoEKernelConfig.from_dict(entry["config"])
        if not cfg.is_valid(_pad(entry["hidden"]), _pad(entry["intermediate"])):
            raise ValueError(f"{path}: entry {i} has an invalid config {cfg}")
    return meta, entries


def config_device_name(device: torch.device) -> str:
    """The name configs are keyed by: the CUDA device name ("cpu" for the Triton interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def config_path(device_name: str, config_dir: Path | None = None) -> Path:
    """Where a device's tuned configs live under ``config_dir`` (default CONFIG_DIR, read at the call:
    MOE_NVFP4_CONFIG_DIR or the shipped configs/)."""
    return (CONFIG_DIR if config_dir is None else config_dir) / KERNEL_NAME / (device_name.replace(" ", "_") + ".json")


def _entries_for(experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str) -> list[dict]:
    dtype_name = str(dtype).removeprefix("torch.")
    key = (experts, hidden, intermediate, dtype_name)
    return [e for e in _tuned_entries(device_name) if (e["experts"], e["hidden"], e["intermediate"], e["dtype"]) == key]


def select_config(
    tokens: int, experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str
) -> MoEKernelConfig:
    """The tuned entry for this device and shape with the smallest max_tokens >= tokens (past every entry,
    the largest one); the default heuristic for a shape with no entry."""
    entries = _entries_for(experts, hidden, intermediate, dtype, device_name)
    if entries:
        return MoEKernelConfig.from_dict(serving_entry(entries, tokens)["config"])
    return default_config(tokens, experts, top_k, hidden, intermediate)


def serving_entry(entries: Sequence[dict], tokens: int) -> dict:
    """Of one shape's tuned entries (not empty), the one that serves ``tokens``: the smallest max_tokens >= tokens,
    past every entry the largest."""
    fits = [e for e in entries if e["max_tokens"] >= tokens]
    return min(fits, key=lambda e: e["max_tokens"]) if fits else max(entries, key=lambda e: e["max_tokens"])


def configs_up_to(
    max_tokens: int, experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str
) -> dict[MoEKernelConfig, int]:
    """Every config ``select_config`` picks for 1..max_tokens tokens, each with the fewest tokens that pick it.

    select_config is constant between the token counts where an entry or a default_config bound ends, so
    checking 1 and each count just past such an end finds every config (what a warm-up must compile).
    """
    ends = [e["max_tokens"] for e in _entries_for(experts, hidden, intermediate, dtype, device_name)]
    ends += [-(-(bound + 1) * experts // top_k) - 1 for bound, _ in DEFAULT_BLOCK_M]  # last T with rows <= bound
    found: dict[MoEKernelConfig, int] = {}
    for tokens in sorted({1} | {end + 1 for end in ends if 0 < end < max_tokens}):
        found.setdefault(select_config(tokens, experts, top_k, hidden, intermediate, dtype, device_name), tokens)
    return found


@lru_cache(maxsize=None)
def _tuned_entries(device_name: str) -> tuple[dict, ...]:
    """The device's tuned entries, read once per process (select_config runs on every forward)."""
    path = config_path(device_name)
    return load_config_file(str(path))[1] if path.exists() else ()
