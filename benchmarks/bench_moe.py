"""The lab's runs of the layer benchmark ``moe-nvfp4 bench`` (``moe_nvfp4.bench.moe``, which says what it measures):
its flags, with this repository's defaults, and moe.png beside the reports.

    python benchmarks/bench_moe.py --out benchmarks/results            # Mixtral and Qwen3 (< 8 min on an H200)
    python benchmarks/bench_moe.py --quick --out /tmp/moe               # 3 token counts, fewer replays
    python benchmarks/bench_moe.py --models zoo --out benchmarks/results/zoo/ranks
    python benchmarks/bench_moe.py --models random:16 --tokens 1024,4096,16384 --out /tmp/random   # 16 random layers
    python benchmarks/bench_moe.py --device cpu --out /tmp/smoke        # the script itself, host clock, seconds
    python benchmarks/bench_moe.py --merge /tmp/gpu0 /tmp/gpu1 --out /tmp/both   # runs taken apart, one report

Defaults here: --models mixtral,qwen3 (on the CPU tiny), --paths ours,marlin,humming,bf16 (a path that cannot run
says why in its rows, as vLLM's do on the CPU), --out benchmarks/results (moe.json, moe.md, and moe.png when
matplotlib is importable).
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the repository's moe_nvfp4, even when not pip-installed
sys.path.insert(0, _HERE)  # plot.py beside this file

from moe_nvfp4.bench import moe  # noqa: E402
from moe_nvfp4.bench.moe import (  # noqa: E402,F401  (tools/power_moe.py and the tests use them from here)
    ALIASES,
    COLUMNS,
    QUICK_TOKENS,
    TINY,
    TOKENS,
    add_ratios,
    columns,
    copies_for,
    make_inputs,
    make_weights,
    model_summaries,
    resolve_models,
)
from moe_nvfp4.bench.paths import PATHS, build_path, clone_tensors, short_error  # noqa: E402,F401
from moe_nvfp4.bench.report import merge_reports, read_report, stdout_report, write_reports  # noqa: E402

DEFAULT_MODELS = ("mixtral", "qwen3")
DEFAULT_PATHS = ("ours", "marlin", "humming", "bf16")


def build_parser() -> argparse.ArgumentParser:
    p = moe.build_parser(prog="bench_moe.py", default_models=",".join(DEFAULT_MODELS))
    p.set_defaults(
        paths=",".join(DEFAULT_PATHS), out="benchmarks/results", repro_command="python benchmarks/bench_moe.py"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RUN",
        default=None,
        help="measure nothing: one report at --out of these runs (their directories or moe.json files), "
        "e.g. one process per GPU of a host, or one command per lease",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return moe.parse_args(argv, build_parser())


def merge(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """--merge: the runs' rows as one report (JSON, Markdown) at args.out; returns its (meta, rows)."""
    try:
        meta, rows = merge_reports([read_report(run) for run in args.merge])
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"bench_moe.py --merge: {short_error(exc)}") from None
    report_args = argparse.Namespace(paths=meta["args"]["paths"], repro_command=args.repro_command)
    print(stdout_report(report_args, meta, rows))
    print(f"wrote {', '.join(write_reports(args.out, report_args, meta, rows))}")
    return meta, rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.merge:
        meta, rows = merge(args)
        device = meta.get("device") or "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU (--device cpu runs a host-clock smoke test of the script itself)")
        return 2
    else:
        rows = moe.run(args)
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    if not args.out.endswith((".json", ".md")):
        png = os.path.join(args.out, "moe.png")
        try:
            from plot import plot_rows

            plot_rows(rows, png, title=f"NVFP4 MoE forward on {device}")
            print(f"wrote {png}")
        except Exception as exc:  # noqa: BLE001 - matplotlib may be absent on the GPU machine
            print(
                f"no plot: {short_error(exc)}; run `python benchmarks/plot.py {args.out}/moe.json` where "
                "matplotlib exists"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
