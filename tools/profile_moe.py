"""Where the time of one fused MoE forward goes: per-kernel CUDA time from the torch profiler, the kernels
launched without programmatic dependent launch (with it, a kernel's time also holds its wait for the one
before: the routing kernel read 129 us at Qwen3 T=4096 that way).

    python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1
    python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1 --per-launch      # GEMM1, GEMM2, ... apart
    python tools/profile_moe.py --model mixtral-8x7b --tokens 4096 --config '{"block_m": 128, ...}'

--ncu runs one forward (after three unprofiled ones, programmatic dependent launch as shipped) between
cudaProfilerStart and cudaProfilerStop, for Nsight Compute (which flushes the caches before each kernel, so
the weights come from HBM):

    ncu --profile-from-start off --set full --clock-control none -o moe \
        python tools/profile_moe.py --model qwen3-30b-a3b --tokens 1 --ncu
    ncu -i moe.ncu-rep --page details; ncu -i moe.ncu-rep --page source --print-source sass --csv
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

from tune_moe import MODELS, packed_layer  # noqa: E402

from moe_nvfp4 import topk_softmax  # noqa: E402
from moe_nvfp4.shapes import LayerShape, device_traits  # noqa: E402
from moe_nvfp4.sm90.configs import MoEKernelConfig
from moe_nvfp4.sm90.host import fused_moe_sm90  # noqa: E402
from moe_nvfp4.sm90.tuned_configs import select_config
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


def forward_of(model: str, tokens: int, config: MoEKernelConfig | None) -> Callable[[], object]:
    """One fused MoE forward of ``model``'s layer (random weights) at ``tokens``, the selected or given config."""
    e, k, h, i = MODELS[model]
    weights = packed_layer(model)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = topk_softmax(torch.randn(tokens, e, device="cuda"), k, renormalize=True)
    cfg = config or select_config(tokens, LayerShape(e, k, h, i, x.dtype), device_traits(x.device))
    return lambda: fused_moe_sm90(x, weights, tw, ti, None, cfg)


def profile(model: str, tokens: int, config: MoEKernelConfig | None, iters: int = 20) -> dict[str, float]:
    per_kernel: dict[str, float] = defaultdict(float)
    for name, us in kernel_times(forward_of(model, tokens, config), iters):
        per_kernel[name[:60]] += us
    return dict(per_kernel)


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
    args = p.parse_args()
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
