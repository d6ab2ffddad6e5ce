"""Where the time of one fused MoE forward goes: per-kernel CUDA time from the torch profiler, the kernels
launched without programmatic dependent launch (with it, a kernel's time also holds its wait for the one
before: the routing kernel read 129 us at Qwen3 T=4096 that way).

    python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1
    python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1 --per-launch      # GEMM1, GEMM2, ... apart
    python tools/profile_moe.py --model mixtral-8x7b --tokens 4096 --config '{"block_m": 128, ...}'

--host times eager forwards through the public API (``moe_nvfp4.fused_moe``: its checks, the op's body, the
backend), as vLLM runs prefill past its CUDA-graph sizes: the wall time of a forward, the host's enqueue time of one
(no wait for the GPU: what the Python and launch path cost; where it nears the wall time the forward is
host-bound), the same with every launch through Triton's ``kernel[grid](...)`` instead of ``triton.launcher`` (the
launcher's A/B, interleaved in one process: design 008 decision 12), and the functions that take the most of the
host's time (cProfile, own time).  ``--w4a8`` runs the W4A8 mode at any T (its e4m3 copy given, fp8_pays' bounds
lifted):

    python tools/profile_moe.py --model qwen3-30b-a3b --tokens 2048 --host --w4a8

--modes times W4A16 and W4A8 eagerly at each of ``--token-list`` (the W4A8 forward run at every T, whatever
``fp8_pays`` would choose; the two interleaved, two rounds, the least kept): where the W4A8 mode starts paying off
in an eager forward, host time included (design 008 decision 13); ``--out`` writes the rows as JSON:

    python tools/profile_moe.py --modes --models qwen3-30b-a3b,mixtral-8x7b --token-list 1024,2048,4096 --out f.json

--ncu runs one forward (after three unprofiled ones, programmatic dependent launch as shipped) between
cudaProfilerStart and cudaProfilerStop, for Nsight Compute (which flushes the caches before each kernel, so
the weights come from HBM):

    ncu --profile-from-start off --set full --clock-control none -o moe \
        python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1 --ncu
    ncu -i moe.ncu-rep --page details; ncu -i moe.ncu-rep --page source --print-source sass --csv
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

from tune_moe import MODELS, packed_layer

from moe_nvfp4 import fused_moe, prepare_fp8_weights, topk_softmax
from moe_nvfp4.bench.layer import config_source
from moe_nvfp4.shapes import LayerShape, device_traits
from moe_nvfp4.sm90 import w4a8
from moe_nvfp4.sm90.configs import MoEKernelConfig
from moe_nvfp4.sm90.host import fused_moe_sm90
from moe_nvfp4.sm90.tuned_configs import select_config
from moe_nvfp4.triton import launcher
from moe_nvfp4.triton.common import plain_launches


def kernel_times(forward: Callable[[], object], iters: int = 20) -> list[tuple[str, float]]:
    """Each kernel launch of one ``forward``, in launch order, with its mean device time in us over ``iters``
    forwards (after three unprofiled ones), every kernel launched without programmatic dependent launch."""
    with plain_launches():
        for _ in range(3):
            forward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                forward()
            torch.cuda.synchronize()
    launches = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    per_forward = len(launches) // iters
    return [
        (launches[j].name, sum(launches[j + per_forward * r].device_time for r in range(iters)) / iters)
        for j in range(per_forward)
    ]


def layer_inputs(model: str, tokens: int):
    """``model``'s layer (random weights) and a forward's inputs at ``tokens``: (weights, x, topk_weights,
    topk_ids)."""
    e, k, h, _ = MODELS[model]
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = topk_softmax(torch.randn(tokens, e, device="cuda"), k, renormalize=True)
    return packed_layer(model), x, tw, ti


def forward_of(model: str, tokens: int, config: MoEKernelConfig | None) -> Callable[[], object]:
    """One fused MoE forward of ``model``'s layer (random weights) at ``tokens``, the selected or given config."""
    weights, x, tw, ti = layer_inputs(model, tokens)
    cfg = config or select_config(tokens, LayerShape(*MODELS[model], x.dtype), device_traits(x.device))
    return lambda: fused_moe_sm90(x, weights, tw, ti, None, cfg)


def profile(model: str, tokens: int, config: MoEKernelConfig | None, iters: int = 20) -> dict[str, float]:
    per_kernel: dict[str, float] = defaultdict(float)
    for name, us in kernel_times(forward_of(model, tokens, config), iters):
        per_kernel[name[:60]] += us
    return dict(per_kernel)


def api_forward_of(model: str, tokens: int, w4a8: bool) -> Callable[[], object]:
    """One forward of ``model``'s layer (random weights) at ``tokens`` through the public API; where ``w4a8``, in the
    W4A8 mode (its copy given, the mode forced at any T)."""
    weights, x, tw, ti = layer_inputs(model, tokens)
    if not w4a8:
        return lambda: fused_moe(x, weights, tw, ti)
    fp8 = prepare_fp8_weights(weights)

    def forward():
        with w4a8_everywhere():  # at any T: fp8_pays' eager work bound would run W4A16 below 200 GFLOP
            return fused_moe(x, weights, tw, ti, fp8_weights=fp8)

    return forward


def host_times(forward: Callable[[], object], iters: int = 20, top: int = 12) -> dict:
    """``forward`` eager, after three forwards (compiles, caches): ``wall_us`` a forward with the GPU waited for,
    ``enqueue_us`` a forward without waiting (the host's cost; the launch queue holds a few forwards' kernels), and
    ``top``: the ``top`` functions by own time under cProfile, (us a forward, where); none and no cProfile run for 0."""
    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        forward()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / iters
    start = time.perf_counter()
    for _ in range(iters):
        forward()
    enqueue = (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    if not top:
        return {"wall_us": wall * 1e6, "enqueue_us": enqueue * 1e6, "top": []}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        forward()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive calls, own, cumulative, ...)
    own = sorted(((v[2], f"{key[2]} ({Path(key[0]).name}:{key[1]})") for key, v in stats.items()), reverse=True)
    return {
        "wall_us": wall * 1e6,
        "enqueue_us": enqueue * 1e6,
        "top": [(seconds / iters * 1e6, where) for seconds, where in own[:top]],
    }


@contextlib.contextmanager
def triton_launches() -> Iterator[None]:
    """Inside, every launch goes through Triton's ``kernel[grid](...)`` (JITFunction.run), as before the launcher:
    the launcher takes that path wherever it does not know Triton's internals."""
    known = launcher.INTERNALS_KNOWN
    launcher.INTERNALS_KNOWN = False
    try:
        yield
    finally:
        launcher.INTERNALS_KNOWN = known


def launcher_ab(forward: Callable[[], object], rounds: int = 2, iters: int = 20) -> dict[str, tuple[float, float]]:
    """(wall_us, enqueue_us) of ``forward`` as shipped and with ``triton_launches``, the two interleaved ``rounds``
    times in one process (the machines are noisy), the least of each kept."""
    best: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        for name, context in (("launcher", contextlib.nullcontext), ("kernel[grid]", triton_launches)):
            with context():
                times = host_times(forward, iters, top=0)
            wall, enqueue = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(wall, times["wall_us"]), min(enqueue, times["enqueue_us"]))
    return best


@contextlib.contextmanager
def w4a8_everywhere() -> Iterator[None]:
    """Inside, a forward given the e4m3 copy runs W4A8 at every T (fp8_pays' rows and eager-work bounds at zero)."""
    bounds = w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS
    w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS = 0, 0.0
    try:
        yield
    finally:
        w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS = bounds


def mode_times(model: str, tokens: int, rounds: int = 2, iters: int = 20) -> dict:
    """Eager wall and enqueue times (us) of ``model``'s layer at ``tokens`` in W4A16 and in W4A8 (forced), the two
    interleaved ``rounds`` times, the least of each kept; with the rows an expert expects (T x top-k / E)."""
    weights, x, tw, ti = layer_inputs(model, tokens)
    fp8 = prepare_fp8_weights(weights)
    forwards = {
        "w4a16": lambda: fused_moe(x, weights, tw, ti),
        "w4a8": lambda: fused_moe(x, weights, tw, ti, fp8_weights=fp8),
    }
    best = {name: {"wall_us": float("inf"), "enqueue_us": float("inf")} for name in forwards}
    with w4a8_everywhere():
        for _ in range(rounds):
            for name, forward in forwards.items():
                times = host_times(forward, iters, top=0)
                for key in best[name]:
                    best[name][key] = min(best[name][key], times[key])
    e, k, _, _ = MODELS[model]
    return {
        "model": model,
        "tokens": tokens,
        "rows_per_expert": tokens * k / e,
        "w4a16_config": config_source(LayerShape(*MODELS[model], x.dtype), device_traits(x.device), tokens),
        **{f"{name}_{key}": round(value, 1) for name, times in best.items() for key, value in times.items()},
        "w4a8_speedup": round(best["w4a16"]["wall_us"] / best["w4a8"]["wall_us"], 3),
    }


def one_forward_for_ncu(forward: Callable[[], object]) -> None:
    """Three forwards (compiles, caches), then one between cudaProfilerStart and cudaProfilerStop."""
    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    forward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--config", default=None, help="MoEKernelConfig as JSON (default: the selected config)")
    p.add_argument("--ncu", action="store_true", help="one forward between cudaProfilerStart/Stop, no timing")
    p.add_argument(
        "--per-launch", action="store_true", help="each launch in order (GEMM1 and GEMM2 share a kernel name)"
    )
    p.add_argument("--host", action="store_true", help="eager forwards through the public API: host vs wall time")
    p.add_argument("--w4a8", action="store_true", help="with --host: the forwards run the W4A8 mode (forced)")
    p.add_argument("--modes", action="store_true", help="W4A16 against W4A8 eagerly, at each of --token-list")
    p.add_argument("--models", default="qwen3-30b-a3b", help="with --modes: comma-separated models")
    p.add_argument("--token-list", default="1024,2048,4096", help="with --modes: comma-separated token counts")
    p.add_argument("--out", default=None, help="with --modes: the rows as JSON")
    args = p.parse_args()
    if args.modes:
        rows = []
        for model in args.models.split(","):
            for tokens in (int(t) for t in args.token_list.split(",")):
                rows.append(mode_times(model, tokens))
                r = rows[-1]
                print(
                    f"{model} T={tokens} ({r['rows_per_expert']:.0f} rows an expert): W4A16 {r['w4a16_wall_us']:.0f} us"
                    f" (enqueued {r['w4a16_enqueue_us']:.0f}), W4A8 {r['w4a8_wall_us']:.0f} us (enqueued"
                    f" {r['w4a8_enqueue_us']:.0f}): W4A8 {r['w4a8_speedup']:.2f}x",
                    flush=True,
                )
        if args.out:
            import triton

            meta = {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "command": "python " + " ".join(sys.argv),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "tuned_entries": any(r["w4a16_config"] != "default" for r in rows),
            }
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    if args.host:
        forward = api_forward_of(args.model, args.tokens, args.w4a8)
        mode = "W4A8" if args.w4a8 else "W4A16"
        for name, (wall, enqueue) in launcher_ab(forward).items():
            print(
                f"{args.model} T={args.tokens} {mode}, eager, {name}: {wall:.0f} us a forward, enqueued in {enqueue:.0f} us"
            )
        for us, where in host_times(forward)["top"]:
            print(f"{us:9.1f} us  {where}")
        return 0
    cfg = MoEKernelConfig.from_dict(json.loads(args.config)) if args.config else None
    if args.ncu:
        one_forward_for_ncu(forward_of(args.model, args.tokens, cfg))
        return 0
    if args.per_launch:
        for j, (name, us) in enumerate(kernel_times(forward_of(args.model, args.tokens, cfg))):
            print(f"{j}  {us:9.1f} us  {name[:60]}")
        return 0
    times = profile(args.model, args.tokens, cfg)
    total = sum(times.values())
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"{us:9.1f} us  {100 * us / total:5.1f}%  {name}")
    print(f"{total:9.1f} us  total device time per forward ({args.model}, T={args.tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
