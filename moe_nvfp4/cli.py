"""Command line: ``moe-nvfp4 demo``."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoShape, run_demo

    print(run_demo(DemoShape(tokens=args.tokens), seed=args.seed, device=args.device))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-nvfp4", description="NVFP4 Mixture-of-Experts tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a random MoE layer and report accuracy against BF16")
    demo.add_argument("--tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
