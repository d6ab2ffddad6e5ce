"""Autotuning: per token bucket, time the configs one step from the one ``select_config`` serves, keep the fastest,
and cache the winners on disk.

    report = autotune_fused_moe(weights, top_k, torch.bfloat16, max_tokens=8192)   # weights on the GPU
    print(report.summary())

Tuning is explicit (design 004, decision 10): ``moe-nvfp4 tune`` (``tune_cli``) runs it ahead of serving and fills
the cache; at load the vLLM plugin only reads it (``load_configs``: ``cached_configs``), unless MOE_NVFP4_AUTOTUNE=1
asks it to tune there.  Without a cache entry the default config serves.

For one layer shape (``shapes.LayerShape``) on one device (``shapes.DeviceTraits``):
1. Buckets (``token_buckets``): the token counts after which the serving config may change (the shape's entry
   ends, else ``default_config``'s bounds), 1 and every fourth power of two up to ``max_tokens``, and
   ``max_tokens``.  A bucket's entry serves the counts above the previous bucket up to its own, and is timed at
   its own.
2. Each bucket is first timed with the config it is served now (a tuned entry or the default).  Then, in rounds
   over the buckets (the fewest tokens first), each tries its next untimed neighbour (``neighbours``: one value
   away); a neighbour faster by MIN_GAIN becomes the bucket's best and its own neighbours come next.  No
   timing starts past ``budget_s`` (compiles included): the search refines, and stopping early keeps what the
   shape had.
3. A candidate's output is checked against the bucket's starting config first (configs differ only in rounding
   order), then timed by CUDA-graph replay after an L2 flush, median of REPS.
4. The winners are registered (``tuned_configs.register_entries``: ``select_config`` serves them in this process) and
   written to ``cache_dir()``, keyed by device, shape, dtype and the package, kernel-source, Triton and torch
   versions (``cache_key``), so the next start reads them and times nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from ..shapes import DeviceTraits, LayerShape, device_traits
from .configs import CHUNK_K, CONFIG_VERSION, KERNEL_NAME, TOKEN_TILES, GemmConfig, MoEKernelConfig
from .default_config import TRITON_PREFILL, WS_ONE_GROUP, WS_TWO_GROUPS, default_bounds, fit_gemm
from .tuned_configs import entries_for, measured_entries, register_entries, select_config

if TYPE_CHECKING:
    from ..weights import MoEWeights

__all__ = [
    "AutotuneReport",
    "BucketResult",
    "autotune_enabled",
    "autotune_fused_moe",
    "cache_dir",
    "cache_key",
    "cached_configs",
    "gpu_timer",
    "load_configs",
    "neighbours",
    "search",
    "token_buckets",
    "tune_layer",
]

SWITCH_ENV = (
    "MOE_NVFP4_AUTOTUNE"  # "1" tunes at load (the vLLM plugin asks autotune_enabled); unset or "0": it does not
)
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")

DEFAULT_BUDGET_S = 50.0  # the search, compiles included; with the final warm-up under a minute a layer shape
MIN_GAIN = 0.03  # a neighbour must beat the bucket's best by this fraction: medians of REPS cold runs vary ~1-2%
REPS = 8
MERGE = 1.25  # bucket ends within this factor of a kept end merge into it (the bound, not the power of two, stays)
# configs.TOKEN_TILES but 256: no tuned entry or default chose a tile past 128 tokens, so the search never tries one
SEARCHED_TILES = tuple(t for t in TOKEN_TILES if t <= 128)
# The Gluon kernel's (register cap, programs per SM) that fit an SM with 4 MMA warps and the loader's warp group.
WS_RESIDENCY = ((None, 1), (168, 1), (128, 2), (80, 3))
WS_RINGS = ((1, 4), (2, 2), (2, 3), (1, 6), (4, 2))  # (K chunks per stage, stages)


def token_buckets(max_tokens: int, shape: LayerShape, device: DeviceTraits) -> list[int]:
    """Bucket ends up to ``max_tokens`` (see the module docstring), ascending."""
    entries = entries_for(shape, device)
    bounds = sorted({e["max_tokens"] for e in entries} if entries else set(default_bounds(shape, device)))
    powers = [4**i for i in range(16) if 4**i <= max_tokens]
    kept = [b for b in bounds if b < max_tokens] + [max_tokens]
    for p in powers:
        if all(not (k / MERGE <= p <= k * MERGE) for k in kept):
            kept.append(p)
    return sorted(set(kept))


def _swap_kernel(g: GemmConfig, k_padded: int, block_m: int, gated: bool) -> GemmConfig:
    """The same tile on the other kernel family: the Gluon kernel at its one- or two-group preset, or Triton's."""
    if g.warp_specialized:
        preset = dict(TRITON_PREFILL, block_n=g.block_n, num_warps=4 if g.block_n == 64 else 8)
    else:
        preset = WS_TWO_GROUPS if g.block_n == 128 and g.num_warps == 8 else dict(WS_ONE_GROUP, block_n=g.block_n)
    return fit_gemm(preset, k_padded, block_m, gated, narrow_tiles=g.narrow_tiles).narrowed_for(block_m)


def _gemm_neighbours(g: GemmConfig, k_padded: int, block_m: int, gated: bool) -> list[GemmConfig]:
    out = [_swap_kernel(g, k_padded, block_m, gated)]  # invalid where the token tile needs the Gluon kernel: dropped
    out.append(replace(g, block_n=64, num_warps=4) if g.block_n == 128 else replace(g, block_n=128))
    if g.warp_specialized:
        here = next((i for i, r in enumerate(WS_RESIDENCY) if r == (g.max_registers, g.programs_per_sm)), None)
        out += [
            replace(g, max_registers=r, programs_per_sm=p)
            for r, p in WS_RESIDENCY[max(0, (here or 0) - 1) : (here or 0) + 2]
        ]
        out += [
            fit_gemm(dict(asdict(g), chunks_per_stage=c, num_stages=s), k_padded, block_m, gated)
            for c, s in WS_RINGS
            if k_padded // CHUNK_K % c == 0
        ]
    else:
        out += [replace(g, programs_per_sm=p) for p in (1, 2) if p != g.programs_per_sm]
        out += [replace(g, num_stages=s) for s in (g.num_stages - 1, g.num_stages + 1) if 2 <= s <= 5]
    out += [replace(g, narrow_tiles=n) for n in (g.narrow_tiles - 1, g.narrow_tiles + 1) if 0 <= n <= 2]
    return out


def neighbours(cfg: MoEKernelConfig, tokens: int, shape: LayerShape) -> list[MoEKernelConfig]:
    """Valid configs one value away from ``cfg``, in the order to try them: the token tile, then per GEMM the
    kernel family, tile rows, residency, ring and narrow MMAs, then the partials' dtype and pair tiles."""
    i = SEARCHED_TILES.index(cfg.block_m) if cfg.block_m in SEARCHED_TILES else 0
    out = [cfg.with_token_tile(bm) for bm in SEARCHED_TILES[max(0, i - 1) : i + 2]]
    k1, k2 = shape.padded_k
    out += [replace(cfg, gemm1=g) for g in _gemm_neighbours(cfg.gemm1, k1, cfg.block_m, shape.gated)]
    out += [replace(cfg, gemm2=g) for g in _gemm_neighbours(cfg.gemm2, k2, cfg.block_m, False)]
    out.append(replace(cfg, partials_in_x_dtype=not cfg.partials_in_x_dtype))
    if tokens * shape.top_k <= 4 * shape.global_experts:  # a few pairs per expert: pair tiles may still pay
        out.append(replace(cfg, pair_tiles=not cfg.pair_tiles))
    return [c for c in dict.fromkeys(out) if c != cfg and shape.accepts(c)]


@dataclass
class BucketResult:
    """One bucket's outcome: the config kept, its time and the starting config's (None: not timed)."""

    tokens: int
    start: MoEKernelConfig
    config: MoEKernelConfig
    start_us: float | None = None
    us: float | None = None
    timed: int = 0
    untried: list[MoEKernelConfig] = field(default_factory=list, repr=False)
    tried: set[MoEKernelConfig] = field(default_factory=set, repr=False)

    def entry(self, shape: LayerShape) -> dict:
        return dict(
            **asdict(shape),
            max_tokens=self.tokens,
            config=self.config.to_dict(),
            time_us=None if self.us is None else round(self.us, 2),
        )


def search(
    buckets: Sequence[int],
    start_of: Callable[[int], MoEKernelConfig],
    next_to: Callable[[MoEKernelConfig, int], list[MoEKernelConfig]],
    measure: Callable[[MoEKernelConfig, int], float | None],
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> list[BucketResult]:
    """Step 2 of the module docstring, with ``measure(cfg, tokens)`` -> microseconds (None: failed or wrong)."""
    deadline = clock() + budget_s
    results = [BucketResult(t, start_of(t), start_of(t)) for t in buckets]

    def time_it(r: BucketResult, cfg: MoEKernelConfig) -> float | None:
        r.tried.add(cfg)
        r.timed += 1
        return measure(cfg, r.tokens)

    for r in results:  # every bucket's starting point first: stopping early leaves each its own time
        if clock() >= deadline:
            return results
        r.start_us = r.us = time_it(r, r.start)
        r.untried = next_to(r.start, r.tokens) if r.us is not None else []
    while any(r.untried for r in results):
        for r in (r for r in results if r.untried):
            if clock() >= deadline:
                return results
            cfg = r.untried.pop(0)
            if cfg in r.tried:
                continue
            us = time_it(r, cfg)
            if us is not None and us < r.us * (1 - MIN_GAIN):
                r.config, r.us = cfg, us
                r.untried = [c for c in next_to(cfg, r.tokens) if c not in r.tried]
    return results


def autotune_enabled() -> bool:
    """Whether autotuning at load is on: MOE_NVFP4_AUTOTUNE=1 (or true, on, yes); unset or 0 (false, off, no), the
    default, reads the cache only.  Another value is refused rather than guessed."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(
            f"{SWITCH_ENV}={os.environ[SWITCH_ENV]!r}: use 1 to autotune at load, or 0 / unset (the "
            "default) to read the cache `moe-nvfp4 tune` fills"
        )
    return value in _ON


# ---- the disk cache ----
@lru_cache(maxsize=None)
def _kernel_digest() -> str:
    """A digest of the sources a config's speed depends on (the kernels and the config rules)."""
    here = Path(__file__).resolve().parent  # this backend's folder; the shared Triton kernels; the routing twin
    h = hashlib.sha256()
    for path in sorted([*here.glob("*.py"), *here.parent.glob("triton/*.py"), here.parent / "routing.py"]):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """MOE_NVFP4_CACHE_DIR, else ~/.cache/moe_nvfp4, then autotune/."""
    root = os.environ.get("MOE_NVFP4_CACHE_DIR") or Path.home() / ".cache" / "moe_nvfp4"
    return Path(root) / "autotune"


def cache_key(shape: LayerShape, device: DeviceTraits) -> dict:
    """Everything a cached choice depends on; a cache file is used only where its key is equal."""
    import triton

    from .. import __version__

    return dict(
        kernel=KERNEL_NAME,
        config_version=CONFIG_VERSION,
        package=__version__,
        kernels=_kernel_digest(),
        triton=triton.__version__,
        torch=torch.__version__,
        device=device.name,
        capability=list(device.capability),
        sm_count=device.sm_count,
        **asdict(shape),  # every LayerShape field
    )


def cache_path(key: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (directory or cache_dir()) / f"{digest}.json"


def read_cache(path: Path, key: dict) -> tuple[int, list[dict]] | None:
    """(the largest token count covered, entries) of a cache file whose key equals ``key``; None otherwise
    (absent, unreadable, another key)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("entries"), list):
        return None
    return int(data.get("max_tokens", 0)), data["entries"]


def write_cache(path: Path, key: dict, max_tokens: int, entries: list[dict], seconds: float) -> None:
    """Atomically (tensor-parallel ranks of one host may write the same file at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(
        key=key,
        max_tokens=max_tokens,
        entries=entries,
        seconds=round(seconds, 1),
        date=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


@dataclass
class AutotuneReport:
    """What autotune_fused_moe (or cached_configs) did for one layer shape."""

    shape: LayerShape
    device: DeviceTraits
    buckets: list[BucketResult]
    seconds: float
    # "timed"; "cache" (read from cache_path); "process" (already chosen in this process); "default" (no usable
    # cache file: the tuned file's entries or the default config serve); "cpu" (nothing to tune)
    source: str
    cache_path: Path | None = None
    covered: int = 0  # "cache": the most tokens the file covers (past them, what serves untuned)

    def summary(self) -> str:
        s = self.shape
        head = (
            f"E={s.experts}"
            + (f"/{s.global_experts}" if s.global_experts != s.experts else "")
            + f" top-{s.top_k} H={s.hidden} I={s.intermediate} {s.dtype}"
            + ("" if s.gated else " non-gated")
            + f" on {self.device.name}"
        )
        if self.source == "default":
            return f"{head}: default configs (no autotune cache at {self.cache_path}; `moe-nvfp4 tune` fills it)"
        if self.source != "timed":
            where = f" ({self.cache_path}" + (f", up to {self.covered} tokens" if self.covered else "") + ")"
            return f"{head}: configs from {self.source}" + (where if self.cache_path else "")
        changed = [
            f"T<={b.tokens} {b.start_us:.1f}->{b.us:.1f} us"
            for b in self.buckets
            if b.config != b.start and b.us is not None and b.start_us is not None
        ]
        timed = sum(b.timed for b in self.buckets)
        return (
            f"{head}: {timed} timings over {len(self.buckets)} buckets in {self.seconds:.1f} s; "
            f"{len(changed)} changed"
            + (f" ({', '.join(changed)})" if changed else "")
            + (f"; cache {self.cache_path}" if self.cache_path else "")
        )


def _served_entries(shape: LayerShape, device: DeviceTraits, buckets: Sequence[int]) -> list[dict]:
    """The configs that serve ``buckets`` now (the tuned file's or the default), as untimed entries."""
    return [
        BucketResult(t, select_config(t, shape, device), select_config(t, shape, device)).entry(shape) for t in buckets
    ]


def cached_configs(
    shape: LayerShape, device: DeviceTraits, max_tokens: int, *, directory: Path | None = None
) -> AutotuneReport:
    """What a start without autotuning serves ``shape`` with up to ``max_tokens`` tokens: the cache file's entries
    where ``cache_dir()`` (or ``directory``) has one for this key, registered as tune_layer registers them, and past
    the tokens it covers the configs that served before (so a file tuned to fewer tokens than the scheduler's
    budget changes nothing above them); no file, or one that cannot be read: source "default", nothing
    registered.  Times nothing."""
    began = time.monotonic()
    if measured_entries(shape, device):
        return AutotuneReport(shape, device, [], 0.0, "process")
    key = cache_key(shape, device)
    path = cache_path(key, directory)
    cached = read_cache(path, key)
    if cached is None:
        return AutotuneReport(shape, device, [], 0.0, "default", path)
    covered, entries = cached
    past = _served_entries(shape, device, [t for t in token_buckets(max_tokens, shape, device) if t > covered])
    try:
        register_entries(device, entries + past)
    except (KeyError, TypeError, ValueError):  # a damaged file: what served before still does
        return AutotuneReport(shape, device, [], 0.0, "default", path)
    return AutotuneReport(shape, device, [], time.monotonic() - began, "cache", path, covered)


# ---- on the GPU ----
def _flush_buffer(device: torch.device) -> torch.Tensor:
    """Bytes that evict the L2 when zeroed: 4 x L2 (at least 256 MiB), so every timing streams cold weights."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return torch.empty(max(4 * l2, 256 << 20) // 4, dtype=torch.int32, device=device)


def _graph_us(run: Callable[[], torch.Tensor], flush: torch.Tensor, reps: int = REPS) -> float:
    """Median microseconds of ``run`` replayed from a CUDA graph, each replay after an L2 flush."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1e3 for start, end in events]
    del graph
    return statistics.median(times)


def tune_layer(
    shape: LayerShape,
    device: DeviceTraits,
    max_tokens: int,
    measure: Callable[[MoEKernelConfig, int], float | None],
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    directory: Path | None = None,
    force: bool = False,
) -> AutotuneReport:
    """Steps 1, 2 and 4 of the module docstring for ``shape`` on ``device``, timing with ``measure(cfg, tokens)``
    (microseconds, None for a failed or wrong candidate): the cache first, then the search for the buckets it does
    not cover.  ``force``: search every bucket again and overwrite the cache file."""
    began = time.monotonic()
    if measured_entries(shape, device) and not force:
        return AutotuneReport(shape, device, [], 0.0, "process")
    key = cache_key(shape, device)
    path = cache_path(key, directory)
    cached = None if force else read_cache(path, key)
    known = {e["max_tokens"]: e for e in cached[1]} if cached else {}
    if cached and cached[0] >= max_tokens:
        try:
            register_entries(device, cached[1])
            return AutotuneReport(shape, device, [], time.monotonic() - began, "cache", path, cached[0])
        except (KeyError, TypeError, ValueError):  # a damaged file: tune again and overwrite it
            known = {}
    covered = cached[0] if known else 0  # tune only the buckets past what the cache covers
    buckets = [t for t in token_buckets(max_tokens, shape, device) if t > covered]
    results = search(
        buckets, lambda t: select_config(t, shape, device), lambda c, t: neighbours(c, t, shape), measure, budget_s
    )
    entries = [e for _, e in sorted(known.items())] + [r.entry(shape) for r in results]
    register_entries(device, entries)
    seconds = time.monotonic() - began
    write_cache(path, key, max_tokens, entries, seconds)
    return AutotuneReport(shape, device, results, seconds, "timed", path)


@contextlib.contextmanager
def gpu_timer(
    weights: MoEWeights, top_k: int, dtype: torch.dtype, expert_map: torch.Tensor | None = None, *, seed: int = 0
) -> Iterator[Callable[[MoEKernelConfig, int], float | None]]:
    """``measure(cfg, tokens)`` for ``weights`` on their GPU (step 3 of the module docstring): microseconds, None
    where the candidate fails or disagrees with the first config timed at that count.  Random x and softmax
    routing over the routing's experts, drawn once per token count; its buffers are freed on exit."""
    from ..routing import topk_softmax
    from .host import fused_moe_sm90

    device = weights.w13_packed.device
    shape = weights.layer_shape(top_k, dtype, expert_map)
    gen = torch.Generator(device=device).manual_seed(seed)
    flush = _flush_buffer(device)
    inputs: dict[int, tuple] = {}
    baseline: dict[int, torch.Tensor] = {}

    def measure(cfg: MoEKernelConfig, tokens: int) -> float | None:
        if tokens not in inputs:
            x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(dtype)
            logits = torch.randn(tokens, shape.global_experts, device=device, generator=gen)
            inputs[tokens] = (x, *topk_softmax(logits, top_k, renormalize=True))
        x, tw, ti = inputs[tokens]

        def run() -> torch.Tensor:
            return fused_moe_sm90(x, weights, tw, ti, expert_map, cfg)

        try:
            out = run().float()
            ref = baseline.setdefault(tokens, out)  # the bucket's starting config is timed first
            if not torch.linalg.vector_norm(out - ref) <= 1e-2 * torch.linalg.vector_norm(ref):  # NaN fails too
                return None
            return _graph_us(run, flush)
        except Exception:  # noqa: BLE001 - a candidate that cannot compile or launch here is skipped
            return None

    try:
        yield measure
    finally:
        del inputs, baseline, flush
        torch.cuda.empty_cache()


def autotune_fused_moe(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    expert_map: torch.Tensor | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    directory: Path | None = None,
    seed: int = 0,
) -> AutotuneReport:
    """Choose, time and register configs for ``weights``' layer shape up to ``max_tokens`` tokens (the module
    docstring says how); ``directory`` overrides cache_dir().  CPU weights: nothing to tune."""
    device = weights.w13_packed.device
    shape = weights.layer_shape(top_k, dtype, expert_map)
    if device.type != "cuda" or max_tokens < 1:
        return AutotuneReport(shape, device_traits(device), [], 0.0, "cpu")
    with gpu_timer(weights, top_k, dtype, expert_map, seed=seed) as measure:
        return tune_layer(shape, device_traits(device), max_tokens, measure, budget_s=budget_s, directory=directory)


def load_configs(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    expert_map: torch.Tensor | None = None,
) -> AutotuneReport:
    """What a serving engine runs at load, once per layer shape, before its warm-up: the cache's configs
    (``cached_configs``; the default where there is none), or with MOE_NVFP4_AUTOTUNE=1 ``autotune_fused_moe``
    (which times what the cache does not cover).  CPU weights: nothing (source "cpu")."""
    device = weights.w13_packed.device
    tune = autotune_enabled()  # a bad MOE_NVFP4_AUTOTUNE is refused on every device
    if device.type != "cuda" or max_tokens < 1:
        return AutotuneReport(weights.layer_shape(top_k, dtype, expert_map), device_traits(device), [], 0.0, "cpu")
    if tune:
        return autotune_fused_moe(weights, top_k, dtype, max_tokens, expert_map=expert_map)
    return cached_configs(weights.layer_shape(top_k, dtype, expert_map), device_traits(device), max_tokens)
