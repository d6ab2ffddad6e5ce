"""Command line: ``moe-nvfp4 demo | convert | inspect``."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoShape, run_demo

    print(run_demo(DemoShape(tokens=args.tokens), seed=args.seed, device=args.device))
    return 0


def _size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MB or a byte count)")


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint import Convention
    from .convert import ConversionError, ConvertOptions, QuantSettings, Selection, convert_checkpoint

    try:
        options = ConvertOptions(
            selection=Selection(all_linear=args.all_linear, include=tuple(args.include), exclude=tuple(args.exclude)),
            settings=QuantSettings(
                convention=Convention(args.format),
                separate_gate_up_scales=args.separate_gate_up_scales,
                input_amax=args.input_amax,
            ),
            device=args.device,
            max_shard_bytes=args.max_shard_size,
        )
        print(convert_checkpoint(args.src, args.dst, options, progress=not args.quiet))
    except (ConversionError, ValueError) as e:  # ValueError: an option out of range (QuantSettings, Selection)
        print(f"moe-nvfp4 convert: error: {e}", file=sys.stderr)
        return 1
    return 0


INSPECT_EXIT_CODES = "exit status: 0 no problems; 1 errors, no NVFP4 tensors, or unreadable; 3 warnings only"


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .convert import ConversionError, fix_checkpoint, inspect_checkpoint

    try:
        report = inspect_checkpoint(args.dir)
        print(report)
        if args.fix is not None:
            report = fix_checkpoint(args.dir, args.fix)
            print(f"\nfixed copy written; its inspection:\n{report}")
    except (ConversionError, CheckpointError) as e:
        print(f"moe-nvfp4 inspect: error: {e}", file=sys.stderr)
        return 1
    return report.exit_code


def _add_convert(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "convert",
        help="quantize a local HF checkpoint's MoE experts (or all linear layers) to NVFP4",
        description="Streams a local HF safetensors checkpoint (SRC) into an NVFP4 checkpoint (DST, must not exist). "
        "Weight-only by default (quant_algo W4A16_NVFP4, no input scales); --input-amax makes it W4A4. "
        "Besides the weights and the rewritten configs, DST gets SRC's top-level regular files that hold no weights "
        "(tokenizer, generation config, ...); subdirectories are not copied (the summary lists them). "
        "The output is checked with inspect's validator before it appears.",
        epilog="exit status: 0 converted (warnings are printed in the summary); 1 error (nothing written)",
    )
    p.add_argument("src", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("dst", help="output directory (created; written beside it first, renamed at the end)")
    p.add_argument("--all-linear", action="store_true", help="also quantize non-expert linear layers (never routers, embeddings, norms, lm_head)")
    p.add_argument("--include", action="append", default=[], metavar="REGEX", help="quantize only tensors whose name matches (repeatable; replaces the default selection)")
    p.add_argument("--exclude", action="append", default=[], metavar="REGEX", help="do not quantize tensors whose name matches (repeatable)")
    p.add_argument("--format", choices=["modelopt", "compressed-tensors"], default="modelopt", help="tensor naming and config convention (default modelopt)")
    p.add_argument("--separate-gate-up-scales", action="store_true", help="exact global scale per gate and per up (default: both share the max)")
    p.add_argument("--input-amax", type=float, default=None, metavar="A", help="W4A4: write input_scale = A / (6*448) on every quantized layer (uncalibrated)")
    p.add_argument("--device", default="cpu", help="torch device to quantize on, e.g. cuda (output bytes are identical)")
    p.add_argument("--max-shard-size", type=_size, default=_size("5GB"), metavar="SIZE", help="output shard size, e.g. 5GB (default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert)


def _add_inspect(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "inspect",
        help="report an NVFP4 checkpoint's format, layers and problems (exit 1 on errors, 3 on warnings only)",
        description="Reads a ModelOpt or compressed-tensors NVFP4 checkpoint and validates every quantized module "
        "with the validator the converter and the vLLM loader use.",
        epilog=f"{INSPECT_EXIT_CODES}. With --fix, the status is that of the fixed copy's inspection.",
    )
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--fix", metavar="OUT", default=None, help="write a copy with gate/up global scales shared (their max); "
                   "refused, naming the expert, where requantizing costs a projection relative error > 0.25")
    p.set_defaults(func=_inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-nvfp4", description="NVFP4 Mixture-of-Experts tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a random MoE layer and report accuracy against BF16")
    demo.add_argument("--tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(func=_demo)
    _add_convert(sub)
    _add_inspect(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
