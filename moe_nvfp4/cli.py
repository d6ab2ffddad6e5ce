"""Command line: ``moe-nvfp4 demo | bench | convert | inspect``, ``moe-nvfp4 --version``.

Every command: Ctrl-C prints one line and exits 130 (convert and ``inspect --fix`` remove their partial output
first); output cut off by a closed pipe (``moe-nvfp4 inspect DIR | head``) ends quietly with status 141, the
128 + SIGPIPE a shell reports for any tool cut off that way (not 0: the rest of the report went unread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def _fail(command: str, message: str) -> int:
    """A refusal the user can act on: one line on stderr, exit status 2 (as argparse's own)."""
    print(f"moe-nvfp4 {command}: error: {message}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    from .bench.device import DeviceError, pick_device
    from .bench.moe import DEFAULT_MODEL, parse_shape, resolve_models
    from .demo import CPU_SHAPE, run_kernel_demo, run_reference_demo

    try:
        if args.model and args.shape:
            raise ValueError("give --model or --shape, not both")
        if args.tokens < 1:
            raise ValueError(f"--tokens {args.tokens}: must be >= 1")
        if args.shape:
            chosen = {args.shape.replace(" ", ""): parse_shape(args.shape)}
        else:
            chosen = resolve_models(args.model or DEFAULT_MODEL)
            if len(chosen) != 1:
                raise ValueError(f"--model {args.model!r}: the demo runs one model (moe-nvfp4 bench runs several)")
        ((key, shape),) = chosen.items()
        device = pick_device(args.device)
    except (ValueError, DeviceError) as e:
        return _fail("demo", str(e))
    if device == "cpu":  # a full-size layer only where asked for: its float64 reference takes minutes on a CPU
        print(run_reference_demo(shape if args.model or args.shape else CPU_SHAPE, tokens=args.tokens, seed=args.seed))
        return 0
    text, ok = run_kernel_demo(key, shape, tokens=args.tokens, seed=args.seed)
    print(text)
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench.device import DeviceError, pick_device
    from .bench.moe import finish_args, run

    try:
        finish_args(args)
        pick_device(args.device)
    except (ValueError, DeviceError) as e:
        return _fail("bench", str(e))
    run(args)
    return 0


def _add_demo(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from .bench.device import DEVICES

    p = sub.add_parser(
        "demo",
        help="run the fused NVFP4 MoE kernel on a real layer shape: accuracy and speed (CPU: the torch reference)",
        description="On an sm_90 GPU: the fused kernel on one model's MoE layer (random weights), its error against "
        "the torch reference, its time against the BF16 paths (torch; vLLM's Triton BF16 and Marlin NVFP4 when vLLM "
        "is installed) and the HBM floor. On a CPU: the torch reference's accuracy against the BF16 layer.",
    )
    p.add_argument(
        "--model", default=None, help="zoo shape key, e.g. qwen3-30b-a3b (the GPU default), mixtral-8x7b, kimi-k2-ep8"
    )
    p.add_argument(
        "--shape", default=None, metavar="E,K,H,I", help="experts, top-k, hidden, intermediate of your own layer"
    )
    p.add_argument("--tokens", type=int, default=64, help="tokens in the batch (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto (default): the GPU where torch sees one")
    p.set_defaults(func=_demo)


def _add_bench(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from .bench.moe import HelpFormatter, add_arguments

    p = sub.add_parser(
        "bench",
        help="time the fused kernel against vLLM's Marlin / BF16 paths and the HBM floor on this GPU",
        description="One MoE layer per model (random weights) at each token count: ours, the baselines this machine "
        "has, the measured floors; a table on stdout, --out for JSON or Markdown.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=_bench)


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
        if not args.json:
            print(report, flush=True)  # before a --fix that may take minutes
        fixed = None if args.fix is None else fix_checkpoint(args.dir, args.fix)
    except (ConversionError, CheckpointError) as e:
        print(f"moe-nvfp4 inspect: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        obj = report.to_json()
        if fixed is not None:
            obj["fixed"] = fixed.to_json()
        print(json.dumps(obj, indent=2))
    elif fixed is not None:
        print(f"\nfixed copy written; its inspection:\n{fixed}")
    return (fixed or report).exit_code


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
    p.add_argument(
        "--all-linear",
        action="store_true",
        help="also quantize non-expert linear layers (never routers, embeddings, norms, lm_head)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="REGEX",
        help="quantize only tensors whose name matches (repeatable; replaces the default selection)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="REGEX",
        help="do not quantize tensors whose name matches (repeatable)",
    )
    p.add_argument(
        "--format",
        choices=["modelopt", "compressed-tensors"],
        default="modelopt",
        help="tensor naming and config convention (default modelopt)",
    )
    p.add_argument(
        "--separate-gate-up-scales",
        action="store_true",
        help="exact global scale per gate and per up (default: both share the max)",
    )
    p.add_argument(
        "--input-amax",
        type=float,
        default=None,
        metavar="A",
        help="W4A4: write input_scale = A / (6*448) on every quantized layer (uncalibrated)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device to quantize on, e.g. cuda (output bytes are identical)"
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default=_size("5GB"),
        metavar="SIZE",
        help="output shard size, e.g. 5GB (default)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert)


def _add_inspect(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "inspect",
        help="report an NVFP4 checkpoint's format, layers and problems (exit 1 on errors, 3 on warnings only)",
        description="Reads a ModelOpt or compressed-tensors NVFP4 checkpoint and validates every quantized module "
        "with the validator the converter and the vLLM loader use.",
        epilog=f"{INSPECT_EXIT_CODES}. With --fix, the status is that of the fixed copy's inspection. "
        "--json: one JSON object, schema in moe_nvfp4.convert.InspectReport.to_json (with --fix, the copy's "
        "report under the key 'fixed').",
    )
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (every problem listed)")
    p.add_argument(
        "--fix",
        metavar="OUT",
        default=None,
        help="write a copy with gate/up global scales shared (their max); "
        "refused, naming the expert, where requantizing costs a projection relative error > 0.25",
    )
    p.set_defaults(func=_inspect)


def _version() -> str:
    import platform

    import torch

    from . import __version__

    return f"moe-nvfp4 {__version__} (torch {torch.__version__}, python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """--version, importing torch only when asked (argparse's own would build the string for every command)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-nvfp4", description="NVFP4 Mixture-of-Experts tools")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_convert(sub)
    _add_inspect(sub)
    from .tune_cli import add_tune_parser  # moe-nvfp4 tune: its own module

    add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
    except KeyboardInterrupt:
        writes = args.command == "convert" or getattr(args, "fix", None) is not None
        removed = "; the partial output was removed" if writes else ""
        print(f"\nmoe-nvfp4 {args.command}: interrupted (Ctrl-C){removed}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
