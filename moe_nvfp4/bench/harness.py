"""Benchmark harness: timing with CUDA graphs, measured ceilings, bytes/FLOPs declarations, floors, reports.

Everything an op-specific benchmark needs that is not about the op itself (``moe_nvfp4.bench.moe``, ``moe-nvfp4
bench`` and the scripts in the repository's ``benchmarks/``):

* ``measure_copy_bandwidth`` / ``measure_bf16_matmul_rate``: the two ceilings, measured on this device.
* ``time_graph``: N calls captured into one CUDA graph, replayed, median per call; rotating call sets
  (one closure per copy of the weights) so a copy is never reused while it can still sit in L2.
  ``time_eager`` is the fallback (CUDA events around single eager calls).
* ``MoEShape``: a MoE layer's bytes (NVFP4 weights of the touched experts) and FLOPs, declared once (``shape``).
* ``floors``: HBM floor, compute floor, their max.
* ``write_json`` / ``markdown_table`` / ``write_markdown``: the reports.

Torch is imported lazily inside the GPU functions only where needed; the math and writers run anywhere.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .shape import MoEShape, nvfp4_matrix_bytes

__all__ = [
    "Ceilings",
    "MoEShape",
    "Timing",
    "environment",
    "estimate_call_ms",
    "floors",
    "format_value",
    "markdown_table",
    "measure_bf16_matmul_rate",
    "measure_ceilings",
    "measure_copy_bandwidth",
    "nvfp4_matrix_bytes",
    "pct_of_floor",
    "ratio",
    "rotation_copies",
    "sync",
    "time_eager",
    "time_graph",
    "time_with_fallback",
    "write_json",
    "write_markdown",
]


# --------------------------------------------------------------------------------------------------
# Ceilings and floors
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    """Measured on this device: copy bandwidth (bytes read + written per second) and bf16 matmul rate."""

    copy_bytes_per_s: float
    bf16_flops_per_s: float
    copy_detail: dict = field(default_factory=dict)
    matmul_detail: dict = field(default_factory=dict)


def floors(bytes_moved: float, flops: float, ceilings: Ceilings) -> dict[str, float]:
    """HBM floor = bytes / copy bandwidth; compute floor = FLOPs / bf16 rate; floor = the larger (µs)."""
    hbm_us = bytes_moved / ceilings.copy_bytes_per_s * 1e6
    compute_us = flops / ceilings.bf16_flops_per_s * 1e6
    return {
        "hbm_floor_us": hbm_us,
        "compute_floor_us": compute_us,
        "floor_us": max(hbm_us, compute_us),
        "bound": "hbm" if hbm_us >= compute_us else "compute",
    }


def pct_of_floor(floor_us: float | None, time_us: float | None) -> float | None:
    """floor / time in percent (100 = at the floor); None when either is missing."""
    if floor_us is None or not time_us:
        return None
    return 100.0 * floor_us / time_us


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (speedup = baseline_time / our_time)."""
    if a is None or not b:
        return None
    return a / b


def rotation_copies(touched_bytes: int, l2_bytes: int, *, factor: float = 4.0, max_copies: int = 16) -> int:
    """How many copies of the weights to rotate through so that, between two uses of one copy, at least
    ``factor`` x L2 of other weights stream through (1 when one call already touches that much)."""
    if touched_bytes <= 0:
        return 1
    return max(1, min(max_copies, math.ceil(factor * l2_bytes / touched_bytes)))


class _HostEvent:
    """torch.cuda.Event's timing interface on the host clock (CPU smoke runs only)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1e3 * (end.t - self.t)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _events():
    """A (start, end) pair of timing events: CUDA events on a GPU, host clock otherwise."""
    import torch

    if _on_gpu():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return _HostEvent(), _HostEvent()


def sync() -> None:
    """torch.cuda.synchronize() on a GPU, nothing on the host."""
    import torch

    if _on_gpu():
        torch.cuda.synchronize()


def _time_calls_ms(fns: Sequence[Callable[[], Any]], iters: int) -> list[float]:
    """Each call bracketed by events, rotating through fns; ms per call."""
    times = []
    for i in range(iters):
        start, end = _events()
        start.record()
        fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _median_events_ms(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    return _time_calls_ms([fn], iters)


def _streaming_rate(
    make_call: Callable[[Any], Callable[[], Any]], moved_per_byte: int, nbytes: int, iters: int, device: str
) -> tuple[float, dict]:
    """Bytes moved per second by the call ``make_call(src)`` returns, ``src`` being ``nbytes`` of random bytes
    (>> L2; at most 64 MiB on the CPU) and each byte of it moving ``moved_per_byte`` bytes. Median."""
    import torch

    if device == "cpu":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    call = make_call(src)
    times = _median_events_ms(call, iters, warmup=3)
    ms = statistics.median(times)
    del src, call
    if device != "cpu":
        torch.cuda.empty_cache()
    detail = {"bytes": nbytes, "iters": iters, "median_ms": ms, "min_ms": min(times)}
    return moved_per_byte * nbytes / (ms * 1e-3), detail


def measure_copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20, device: str = "cuda") -> tuple[float, dict]:
    """Device-to-device copy of ``nbytes`` (>> L2); bandwidth counts bytes read + written. Median."""
    import torch

    def copy(src):
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return _streaming_rate(copy, 2, nbytes, iters, device)


def measure_bf16_matmul_rate(n: int = 8192, iters: int = 20, device: str = "cuda") -> tuple[float, dict]:
    """torch.mm of two bf16 [n, n] matrices (cuBLAS); 2 n^3 FLOPs per call. Median."""
    import torch

    if device == "cpu":
        n = min(n, 512)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    times = _median_events_ms(lambda: torch.mm(a, b, out=c), iters, warmup=5)
    ms = statistics.median(times)
    del a, b, c
    if device != "cpu":
        torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3), {"n": n, "iters": iters, "median_ms": ms, "min_ms": min(times)}


def measure_ceilings(*, quick: bool = False, device: str = "cuda") -> Ceilings:
    bw, bw_detail = measure_copy_bandwidth(iters=10 if quick else 20, device=device)
    rate, mm_detail = measure_bf16_matmul_rate(iters=10 if quick else 20, device=device)
    return Ceilings(bw, rate, bw_detail, mm_detail)


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Per-call time in microseconds over ``samples`` measurements (each the mean of ``calls`` calls)."""

    median_us: float
    min_us: float
    max_us: float
    method: str  # "graph" or "eager"
    calls: int  # calls per measurement (per graph replay)
    samples: int
    rotation: int  # distinct input sets rotated through
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _timing(per_call_ms: Sequence[float], method: str, calls: int, rotation: int, note: str = "") -> Timing:
    us = [1e3 * t for t in per_call_ms]
    return Timing(statistics.median(us), min(us), max(us), method, calls, len(us), rotation, note)


def estimate_call_ms(fns: Sequence[Callable[[], Any]], iters: int = 3) -> float:
    """Median eager time of one call (after the caller's warm-up), to size the graph."""
    return statistics.median(_time_calls_ms(fns, iters))


def time_eager(fns: Sequence[Callable[[], Any]], *, iters: int = 20, warmup: int = 3, note: str = "") -> Timing:
    """CUDA events around single eager calls (launch overhead included), rotating through ``fns``."""
    for i in range(max(warmup, len(fns))):
        fns[i % len(fns)]()
    sync()
    return _timing(_time_calls_ms(fns, iters), "eager", 1, len(fns), note)


def time_graph(
    fns: Sequence[Callable[[], Any]],
    *,
    target_graph_ms: float = 25.0,
    max_calls: int = 400,
    replays: int = 10,
    warmup: int = 2,
    replay_log: list[tuple[float, float]] | None = None,
    idle_s: float = 0.0,
) -> Timing:
    """Capture N calls into one CUDA graph (call i runs ``fns[i % len(fns)]``), replay it ``replays``
    times after ``warmup`` replays; per-call time = replay time / N, median over replays.

    N is a multiple of len(fns), sized from an eager estimate so one replay takes about
    ``target_graph_ms``.  The callables must already be warm (JIT compiled, configs cached).
    ``replay_log``: each timed replay's (wall-clock start, µs per call) is appended to it; ``idle_s``: seconds the
    GPU idles before the timed replays (tools/power_moe.py: how the time moves as a cool GPU heats up).
    """
    import torch

    if not _on_gpu():
        raise RuntimeError("CUDA graphs need a GPU")
    n_rot = len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch recommends before capture
        for i in range(max(2, n_rot)):
            fns[i % n_rot]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    est_ms = max(estimate_call_ms(fns), 1e-3)
    calls = max(1, min(max_calls, round(target_graph_ms / est_ms)))
    calls = n_rot * max(1, math.ceil(calls / n_rot))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % n_rot]()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    time.sleep(idle_s)
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        wall = time.time()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
        if replay_log is not None:
            replay_log.append((wall, 1e3 * per_call[-1]))
    del graph
    return _timing(per_call, "graph", calls, n_rot, f"eager estimate {1e3 * est_ms:.1f} us")


def time_with_fallback(fns: Sequence[Callable[[], Any]], **graph_kwargs) -> Timing:
    """time_graph, or time_eager (marked) when capture fails."""
    try:
        return time_graph(fns, **graph_kwargs)
    except Exception as exc:  # capture can fail for ops that sync or allocate on the host
        sync()
        msg = f"graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        return time_eager(fns, note=msg)


# --------------------------------------------------------------------------------------------------
# Environment and reports
# --------------------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - report why, do not fail
        return f"unavailable ({type(exc).__name__})"


def _git(*args: str) -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def environment(extra_modules: Iterable[str] = ()) -> dict[str, Any]:
    """Device, versions, command line, date, git commit."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["device"] = props.name
            env["capability"] = f"{props.major}.{props.minor}"
            env["sm_count"] = props.multi_processor_count
            env["memory_gib"] = round(props.total_memory / 2**30, 1)
            env["l2_bytes"] = getattr(props, "L2_cache_size", None)
    except Exception as exc:  # noqa: BLE001
        env["torch"] = f"unavailable ({type(exc).__name__})"
    for mod in ("triton", *extra_modules):
        env[mod] = _version(mod)
    return env


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    """{"meta": ..., "rows": [...]}; NaN/inf become null so the file is strict JSON."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean({"meta": meta, "rows": rows}), f, indent=2, default=str)
        f.write("\n")


def format_value(v: Any, spec: str = ".1f") -> str:
    """A table cell: ``v`` in ``spec``, '-' where it is missing or not finite."""
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "-"
    if isinstance(v, (int, float)) and spec:
        return format(v, spec)
    return str(v)


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); missing or None values print as '-'. Pipes are escaped."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" if spec else "---" for _, _, spec in columns) + "|"
    lines = [head, rule]
    for row in rows:
        cells = [format_value(row.get(key), spec).replace("|", "\\|") for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(path: str, title: str, meta_lines: Sequence[str], table: str, notes: Sequence[str] = ()) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# {title}\n\n")
        for line in meta_lines:
            f.write(f"- {line}\n")
        f.write("\n" + table + "\n")
        if notes:
            f.write("\n" + "\n".join(notes) + "\n")
