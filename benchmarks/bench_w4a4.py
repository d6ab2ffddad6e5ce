"""W4A4 NVFP4 grouped GEMM (moe_nvfp4.grouped_gemm_nvfp4) on the four shapes of the public B200 NVFP4
group-GEMM problem, against each shape's memory floor on this GPU.

    python benchmarks/bench_w4a4.py --out benchmarks/results          # writes w4a4.json and w4a4.md

Per problem: groups of A [M_g, K] (quantized activations) and B [N, K] (quantized weights), fp16 out.  The
output is checked against the torch reference first; then one plan per rotated copy of the inputs is
launched inside a CUDA graph (median per launch).  Floors: bytes (A and B packed values and e4m3 scales,
fp16 output) / measured copy bandwidth, and FLOPs / measured bf16 matmul rate.  The issue's bar: within
1.5x of the memory floor.  ``--device cpu --shrink 64`` runs the script under the Triton interpreter
(TRITON_INTERPRET=1) on tiny shapes, host-clock timed, to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # harness.py
sys.path.insert(0, os.path.dirname(HERE))

from harness import (  # noqa: E402
    environment,
    floors,
    markdown_table,
    measure_ceilings,
    nvfp4_matrix_bytes,
    pct_of_floor,
    rotation_copies,
    time_with_fallback,
    write_json,
    write_markdown,
)

# (M per group, N, K) of the four problems
PROBLEMS = [
    ([80, 176, 128, 72, 64, 248, 96, 160], 4096, 7168),
    ([40, 76, 168, 72, 164, 148, 196, 160], 7168, 2048),
    ([192, 320], 3072, 4096),
    ([128, 384], 4096, 1536),
]
COLUMNS = [
    ("problem", "problem", ""),
    ("groups", "G", ""),
    ("m_total", "sum M", ""),
    ("n", "N", ""),
    ("k", "K", ""),
    ("us", "ours µs", ".1f"),
    ("hbm_floor_us", "memory floor µs", ".1f"),
    ("compute_floor_us", "compute floor µs", ".1f"),
    ("x_memory_floor", "× memory floor", ".2f"),
    ("pct_of_floor", "% of max floor", ".0f"),
    ("tflops", "TFLOP/s", ".0f"),
    ("rel_err", "err", ".1e"),
]


def shrink(problem: tuple[list[int], int, int], factor: int) -> tuple[list[int], int, int]:
    """Divide every size by ``factor``, keeping M >= 1 and N, K multiples of 16."""
    ms, n, k = problem
    return [max(1, mm // factor) for mm in ms], max(16, n // factor // 16 * 16), max(16, k // factor // 16 * 16)


def problem_bytes(ms: list[int], n: int, k: int) -> int:
    """What one launch must move at least: A and B (packed values, block and global scales), fp16 out."""
    return sum(nvfp4_matrix_bytes(mm, k) + nvfp4_matrix_bytes(n, k) + 2 * mm * n for mm in ms)


def make_problem(ms: list[int], n: int, k: int, device: str, seed: int):
    import torch

    import moe_nvfp4 as m

    g = torch.Generator(device=device).manual_seed(seed)
    a = [m.quantize_nvfp4(torch.randn(mm, k, device=device, generator=g)) for mm in ms]
    b = [m.quantize_nvfp4(torch.randn(n, k, device=device, generator=g) / k**0.5) for _ in ms]
    return a, b


def run_problem(index: int, problem, args, ceilings, l2_bytes: int) -> dict:
    import torch

    import moe_nvfp4 as m

    ms, n, k = problem
    moved, flops = problem_bytes(ms, n, k), 2 * sum(ms) * n * k
    a, b = make_problem(ms, n, k, args.device, seed=index)
    out = m.grouped_gemm_nvfp4(a, b)
    ref = m.grouped_gemm_nvfp4_torch(a, b)
    got, want = torch.cat([o.float().flatten() for o in out]), torch.cat([r.float().flatten() for r in ref])
    rel_err = ((got - want).norm() / want.norm()).item()
    if not rel_err < args.tol:
        raise AssertionError(f"problem {index}: ||out - ref|| / ||ref|| = {rel_err:.3g} >= {args.tol}")
    # distinct inputs per launch so the L2 does not serve repeated weights (one set when they cannot fit)
    copies = 1 if args.device == "cpu" else rotation_copies(moved, l2_bytes)
    plans = [
        m.plan_grouped_gemm_nvfp4(*make_problem(ms, n, k, args.device, seed=index + 100 * c)) for c in range(copies)
    ]
    timing = time_with_fallback([lambda p=p: m.launch_grouped_gemm_nvfp4(p) for p in plans])
    row = dict(
        problem=index + 1,
        groups=len(ms),
        m_total=sum(ms),
        n=n,
        k=k,
        ms=ms,
        bytes=moved,
        flops=flops,
        us=timing.median_us,
        timing=timing.as_dict(),
        rel_err=rel_err,
        copies=copies,
        **floors(moved, flops, ceilings),
    )
    row["x_memory_floor"] = row["us"] / row["hbm_floor_us"]
    row["pct_of_floor"] = pct_of_floor(row["floor_us"], row["us"])
    row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--problems", default="1,2,3,4", help="comma list of problem numbers (1-4)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shrink", type=int, default=1, help="divide every size by this (a smoke run of the script)")
    p.add_argument("--tol", type=float, default=2e-3, help="largest accepted ||out - ref|| / ||ref||")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_w4a4: needs a CUDA GPU (--device cpu with TRITON_INTERPRET=1 checks the script)")
        return 2
    if args.device == "cpu":
        os.environ.setdefault("MOE_NVFP4_BACKEND", "triton")
    meta = environment()
    ceilings = measure_ceilings(quick=args.device == "cpu", device=args.device)
    meta["ceilings"] = {"copy_GBps": ceilings.copy_bytes_per_s / 1e9, "bf16_TFLOPs": ceilings.bf16_flops_per_s / 1e12}
    meta["shrink"] = args.shrink
    l2 = meta.get("l2_bytes") or 50 * 2**20
    rows = []
    for number in (int(s) for s in args.problems.split(",")):
        rows.append(run_problem(number - 1, shrink(PROBLEMS[number - 1], args.shrink), args, ceilings, l2))
        print(
            " ".join(
                f"{key}={rows[-1][key]:.4g}" if isinstance(rows[-1][key], float) else f"{key}={rows[-1][key]}"
                for key, _, _ in COLUMNS
            ),
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "w4a4.json"), meta, rows)
    lines = [
        f"device: {meta.get('device', 'cpu')}, torch {meta['torch']}, triton {meta['triton']}",
        f"copy bandwidth {meta['ceilings']['copy_GBps']:.0f} GB/s, bf16 matmul {meta['ceilings']['bf16_TFLOPs']:.0f} TFLOP/s",
        f"command: `{meta['command']}`; {meta['date']}; commit {meta.get('git_commit')}"
        + (" (dirty)" if meta.get("git_dirty") else ""),
        f"timing: {rows[0]['timing']['method'] if rows else '-'} (graph = CUDA graph replay) of prepared launches "
        "(moe_nvfp4.plan_grouped_gemm_nvfp4), median per launch, inputs rotated so the L2 does not hold them"
        + (f"; sizes divided by {args.shrink}" if args.shrink > 1 else ""),
    ]
    write_markdown(os.path.join(args.out, "w4a4.md"), "W4A4 NVFP4 grouped GEMM", lines, markdown_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
