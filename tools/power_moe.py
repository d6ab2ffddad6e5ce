"""Power and clocks while one path runs back to back: a bench_moe.py path (ours, vLLM's Marlin NVFP4 or its Triton
BF16) on bench_moe's weights, inputs and rotated copies, timed in rounds of CUDA-graph replays (harness.time_graph),
with ``nvidia-smi`` sampling the GPU alongside; per round its time and what the samples inside it saw (SM clock,
power, throttle reasons).

    python tools/power_moe.py --model mixtral --tokens 16 --rounds 25 --out benchmarks/results/archive/power/ours.json
    python tools/power_moe.py --model mixtral --tokens 16 --path marlin --rounds 25
    python tools/power_moe.py --model mixtral --tokens 16 --rounds 10 --cool-s 5     # rounds from a cool GPU
    python tools/power_moe.py --model mixtral --tokens 16 --replays 150 --cool-s 8   # every replay, from idle on

A forward that keeps the GPU at its power limit runs at lower SM clocks after its first rounds (throttle reason
"sw_power_cap"); ``--cool-s`` idles between rounds, so each starts cool; ``--replays`` times each replay of one
capture from a cool start, the finest view of how the time moves as the GPU heats up.  Needs a GPU and nvidia-smi
(and vLLM 0.26.0 for the marlin and bf16 paths).
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

import bench_moe as B  # noqa: E402  (no torch at import: its paths import it when built)

SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
# nvidia-smi's clocks_throttle_reasons bits (nvml.h, nvmlClocksEventReasons)
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


@dataclass(frozen=True)
class Sample:
    """One nvidia-smi line: wall time (s since the epoch, UTC), SM and memory clocks (MHz), power (W), degrees C,
    throttle reason bits."""

    t: float
    sm_mhz: float
    mem_mhz: float
    watts: float
    celsius: float
    reasons: int


def parse_samples(lines: list[str]) -> list[Sample]:
    """``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader`` lines, e.g. ``2026/11/26 02:15:44.123, 1980 MHz,
    3201 MHz, 690.50 W, 51, 0x0000000000000004``; lines that do not parse (a partial last line) are skipped."""
    samples = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 6:
            continue
        try:
            stamp = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            sm, mem, watts = (float(c.split()[0]) for c in cells[1:4])
            samples.append(Sample(stamp, sm, mem, watts, float(cells[4]), int(cells[5], 16)))
        except ValueError:
            continue
    return samples


def reason_names(bits: int) -> list[str]:
    """The named throttle reasons in ``bits``, and the raw value too where it holds bits not named here."""
    unnamed = bits & ~functools.reduce(operator.or_, THROTTLE_REASONS)
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit] + ([f"0x{bits:x}"] if unnamed else [])


def summarize(rounds: list[dict], samples: list[Sample]) -> list[dict]:
    """Each round ({round, start, end, us}) with the samples taken inside it: their median and lowest SM clock,
    median and highest power, highest temperature and every throttle reason any of them names (only the count, 0,
    where no sample fell inside the round)."""
    rows = []
    for r in rounds:
        inside = [s for s in samples if r["start"] <= s.t <= r["end"]]
        seen = dict(samples=len(inside))
        if inside:
            sm, watts = [s.sm_mhz for s in inside], [s.watts for s in inside]
            seen.update(
                sm_mhz_median=statistics.median(sm),
                sm_mhz_min=min(sm),
                watts_median=statistics.median(watts),
                watts_max=max(watts),
                celsius_max=max(s.celsius for s in inside),
                throttle=reason_names(functools.reduce(operator.or_, (s.reasons for s in inside))),
            )
        rows.append({**r, **seen})
    return rows


def bench_forwards(model: str, tokens: int, path: str) -> list:
    """bench_moe.py's ``path`` at (model, tokens): one forward per weight copy bench_moe would rotate through."""
    import torch

    shape = B.resolve_models(model)[B.ALIASES.get(model, model)]
    bench = B.build_parser().parse_args([])  # bench_moe's defaults: seed, rotation
    copies = B.copies_for(shape, [tokens], path, bench, torch.cuda.get_device_properties(0).L2_cache_size)
    built = B.build_path(path, shape, B.make_weights(shape, bench.seed, "cuda"), copies)
    x, topk_weights, topk_ids, expert_map = B.make_inputs(shape, tokens, bench.seed, "cuda")
    return [built.fn(c, x, topk_weights, topk_ids, expert_map) for c in range(len(built.weights))]


def time_rounds(forwards: list, rounds: int, cool_s: float) -> list[dict]:
    """``rounds`` timings (each a harness.time_graph median: a new capture, 2 warm-up and 10 timed replays), each
    after ``cool_s`` idle, wall-stamped."""
    from harness import time_graph

    out = []
    for r in range(rounds):
        time.sleep(cool_s)
        start = time.time()
        us = time_graph(forwards).median_us
        out.append(dict(round=r, start=start, end=time.time(), us=us))
        print(json.dumps(out[-1]), flush=True)
    return out


def time_replays(forwards: list, replays: int, cool_s: float) -> list[dict]:
    """One capture replayed ``replays`` times back to back after ``cool_s`` idle, each replay timed and
    wall-stamped: how a forward's time moves as the GPU heats up (rows as time_rounds', one per replay)."""
    from harness import time_graph

    log: list[tuple[float, float]] = []
    timing = time_graph(forwards, replays=replays, warmup=0, replay_log=log, idle_s=cool_s)
    return [dict(round=r, start=wall, end=wall + 1e-6 * us * timing.calls, us=us) for r, (wall, us) in enumerate(log)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mixtral", help="a bench_moe.py --models name (mixtral, qwen3, a zoo shape key)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--path", default="ours", choices=B.PATHS)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--cool-s", type=float, default=0.0, help="seconds idle before each round (--replays: before all)")
    p.add_argument(
        "--replays",
        type=int,
        default=0,
        help="instead of rounds: one capture replayed this many times, each replay timed",
    )
    p.add_argument("--interval-ms", type=int, default=100, help="nvidia-smi's sampling period")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON: the rounds with their samples' summary, and the samples"
    )
    args = p.parse_args()
    query = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", f"-lms={args.interval_ms}"]
    # into a file, line-buffered: a pipe nobody reads until the end fills at 64 KiB and stalls nvidia-smi, and
    # block-buffered output loses its last block at terminate()
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen((["stdbuf", "-oL"] if shutil.which("stdbuf") else []) + query, stdout=log, text=True)
        try:
            forwards = bench_forwards(args.model, args.tokens, args.path)
            if args.replays:
                rounds = time_replays(forwards, args.replays, args.cool_s)
            else:
                rounds = time_rounds(forwards, args.rounds, args.cool_s)
        finally:
            time.sleep(2 * args.interval_ms / 1000)  # the samples of the last round's end
            smi.terminate()
            smi.wait()
        log.seek(0)
        samples = parse_samples(log.read().splitlines())
    rows = summarize(rounds, samples)
    for row in rows:
        clocks = (
            f"SM {row['sm_mhz_median']:.0f} MHz (min {row['sm_mhz_min']:.0f}), {row['watts_max']:.0f} W max, "
            f"{','.join(row['throttle']) or 'no throttling'}"
            if row["samples"]
            else "no sample"
        )
        print(f"{'replay' if args.replays else 'round'} {row['round']:3d}: {row['us']:9.1f} us  {clocks}")
    if args.out:
        from harness import environment

        args.out.parent.mkdir(parents=True, exist_ok=True)
        run = dict(
            model=args.model,
            tokens=args.tokens,
            path=args.path,
            cool_s=args.cool_s,
            replays=args.replays,
            environment=environment(),
        )
        args.out.write_text(json.dumps(dict(run, rounds=rows, samples=[asdict(s) for s in samples]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
