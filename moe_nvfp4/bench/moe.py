"""NVFP4 MoE forward: ours vs vLLM 0.26 Marlin NVFP4 (and Humming NVFP4) vs vLLM Triton BF16 (or torch BF16),
against measured floors.  ``moe-nvfp4 bench`` runs it; so does the repository's ``benchmarks/bench_moe.py``.

    moe-nvfp4 bench                                          # Qwen3-30B-A3B, the paths this machine has
    moe-nvfp4 bench --model mixtral-8x7b --tokens 1,64 --out mixtral.json
    moe-nvfp4 bench --shape 64,8,2048,1024 --paths ours,bf16 --out layer.md
    moe-nvfp4 bench --models zoo-models,random:16 --tokens 1024,4096,16384   # prefill on the zoo and 16 random layers
    moe-nvfp4 bench --device cpu                             # a smoke test of the bench on the CPU (seconds)
    python benchmarks/bench_moe.py --models zoo --out benchmarks/results/zoo/ranks   # the lab's runs

One process, one GPU.  For each model and token count T: random bf16 x and router logits, softmax
top-k (renormalized), random bf16 expert weights quantized once to NVFP4 (one global scale per expert
and matrix, as vLLM's ModelOpt path uses for w13); all the paths (``moe_nvfp4.bench.paths``) compute the same
function on the same dequantized weights.  Outputs are checked against each other (and a float32 torch reference)
before timing; timing is CUDA graph replay with rotating weight copies so L2 never holds the weights between calls
(``moe_nvfp4.bench.harness``).  vLLM is imported only by the paths that use it.  A shape's rows are
``moe_nvfp4.bench.layer``'s, the reports ``moe_nvfp4.bench.report``'s; this module is the command line and the run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import time
import traceback
from dataclasses import asdict
from typing import Callable

from .harness import Ceilings, MoEShape, environment, measure_ceilings  # noqa: F401  (Ceilings: the demo's tests)
from .layer import (  # noqa: F401  (re-exported: benchmarks/bench_moe.py, tools/ and the tests use them from here)
    add_ratios,
    copies_for,
    empty_cache,
    log,
    make_inputs,
    make_weights,
    repro_command,
    run_model,
)
from .paths import PATHS, REGISTRY, short_error
from .report import (  # noqa: F401  (COLUMNS, columns, model_summaries: re-exported as above)
    COLUMNS,
    columns,
    configs_meta,
    model_summaries,
    prefill_summary,
    stdout_report,
    write_reports,
)

# --models: zoo shape keys (moe_nvfp4.zoo), "zoo" (every shape), "zoo-models" (every model at TP=1), "random:N[:SEED]"
# (N layers drawn at random, moe_nvfp4.zoo.random_models), the two shapes the bench always had by their short names,
# and a smoke shape for checking the bench itself (the CPU's default).
ALIASES = {"mixtral": "mixtral-8x7b", "qwen3": "qwen3-30b-a3b"}
TINY = MoEShape("tiny", experts=4, top_k=2, hidden=128, intermediate=64, renormalize=True)
DEFAULT_MODEL = "qwen3-30b-a3b"
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_TOKENS = (1, 64, 1024)
# --device cpu without --models/--shape/--tokens: the smoke shape at three sizes, one round (seconds, not minutes:
# ours is the torch reference there, and nothing measured on a CPU says anything about the kernel)
CPU_MODEL, CPU_TOKENS = "tiny", (1, 16, 64)
REL_TOL = 2e-2  # same dequantized weights everywhere; only bf16 rounding/accumulation order differ
# api.fused_moe's limits, which an explicit --shape must meet
MAX_EXPERTS, MAX_TOP_K, DIM_MULTIPLE = 1024, 16, 16


def quiet_vllm() -> None:
    """Keep vLLM's INFO lines out of the output: set before vLLM is first imported (the user's setting wins)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def available_paths(device: str = "cuda") -> list[str]:
    """The paths this machine's packages can build (each path's ``requires``; the torch loop only where vLLM's
    baselines are missing, so a row always has one); on the CPU ours and the torch loop, vLLM's paths needing a
    GPU.  Looked up, not imported: a path whose package fails to import reports that in its rows."""
    has = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731
    if device == "cpu":
        return ["ours", "torch"]
    return [
        name
        for name, cls in REGISTRY.items()
        if all(has(m) for m in cls.requires) and not any(has(m) for m in cls.auto_unless)
    ]


def package_version(distribution: str) -> str:
    """An installed distribution's version from its metadata (nothing imported), or 'not installed'."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------------------------------
# Command line: ``moe-nvfp4 bench`` and benchmarks/bench_moe.py (which changes the defaults: set_defaults)
# --------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, *, default_models: str = DEFAULT_MODEL) -> None:
    """The bench's options on ``p``: what runs here, how it is measured below; ``default_models`` run when neither
    --models nor --shape is given."""
    p.add_argument(
        "--models",
        "--model",
        default=None,
        help=f"comma list of zoo shape keys (e.g. {DEFAULT_MODEL}, kimi-k2-ep8, glm-4.5-tp4), 'zoo' (every "
        "shape), 'zoo-models' (each model at TP=1), 'random:N' or 'random:N:SEED' (N layers drawn at "
        "random, keyed random-s<SEED>-<i>: the same seed draws the same layers), or mixtral, qwen3, "
        f"tiny (default {default_models}, on the CPU {CPU_MODEL}; none with --shape)",
    )
    p.add_argument(
        "--shape",
        default=None,
        metavar="E,K,H,I",
        help="a layer of your own: experts, top-k, hidden and intermediate sizes (H, I multiples of 16)",
    )
    p.add_argument(
        "--tokens",
        default=None,
        help=f"comma list of token counts (default {','.join(map(str, TOKENS))}; "
        f"--quick {','.join(map(str, QUICK_TOKENS))}; on the CPU {','.join(map(str, CPU_TOKENS))})",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=1,
        help="leave out the token counts under this (e.g. 1024: the default list's prefill sizes only)",
    )
    p.add_argument(
        "--paths",
        default="auto",
        help=f"comma list of {', '.join(PATHS)}, or auto: ours, with vLLM its marlin, bf16 (and humming "
        "where humming-kernels is installed: its first forward per shape JIT-compiles, ~20-30 s), "
        "without vLLM (or on the CPU) torch",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="also write the results: FILE.json (rows and meta), FILE.md (report), or a directory "
        "(moe.json and moe.md)",
    )
    _add_measurement_arguments(p)
    # not options: the models run when neither --models nor --shape is given, and the command a row's repro names
    p.set_defaults(default_models=default_models, repro_command="moe-nvfp4 bench")


def _add_measurement_arguments(p: argparse.ArgumentParser) -> None:
    """How each row is measured: autotune, replays, rounds, weight rotation, the reference check, the device."""
    p.add_argument(
        "--autotune",
        action="store_true",
        help="autotune each shape's configs first (moe_nvfp4.sm90.autotune, its on-disk cache included)",
    )
    p.add_argument("--autotune-budget-s", type=float, default=50.0, help="the autotuner's search budget per shape")
    p.add_argument("--quick", action="store_true", help="fewer token counts, replays and ceiling iterations")
    p.add_argument(
        "--replays", type=int, default=None, help="graph replays per measurement (default 10; quick and CPU 5)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measurements per path, the paths in turn; the row takes their median (default 3; quick and CPU 1)",
    )
    p.add_argument(
        "--target-graph-ms", type=float, default=None, help="calls per graph sized to this (default 20; quick 10)"
    )
    p.add_argument("--max-calls", type=int, default=400, help="upper bound on calls captured per graph")
    p.add_argument(
        "--l2-factor",
        type=float,
        default=4.0,
        help="rotate weight copies until this many L2 sizes stream between reuses",
    )
    p.add_argument("--max-copies", type=int, default=16, help="most weight copies per path (memory)")
    p.add_argument("--no-rotate", action="store_true", help="one weight copy (L2 may stay warm for tiny T)")
    p.add_argument("--no-ref", action="store_true", help="skip the float32 torch reference check")
    p.add_argument("--tol", type=float, default=REL_TOL, help="relative-error bound vs the BF16 path")
    p.add_argument("--seed", type=int, default=0, help="the weights' and inputs' seed (random:N has its own)")
    p.add_argument("--time-budget-s", type=float, default=420.0, help="skip remaining rows after this many seconds")
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: smoke-test the bench itself (the torch reference for ours, host clock, no graphs)",
    )
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing paths")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, or a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser(prog: str | None = None, *, default_models: str = DEFAULT_MODEL) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="NVFP4 MoE forward: moe_nvfp4.fused_moe vs vLLM Marlin (and Humming) NVFP4 vs vLLM Triton BF16 "
        "(or torch BF16), against measured HBM/compute floors.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p, default_models=default_models)
    return p


def parse_shape(text: str) -> MoEShape:
    """--shape "E,K,H,I" -> its MoEShape (named by the four numbers); ValueError naming what fused_moe refuses."""
    try:
        e, k, h, i = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"--shape {text!r}: give four integers E,K,H,I (experts, top-k, hidden, intermediate), e.g. 128,8,2048,768"
        ) from None
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"--shape {text!r}: experts E={e} must be in 1..{MAX_EXPERTS}")
    if not 1 <= k <= min(e, MAX_TOP_K):
        raise ValueError(f"--shape {text!r}: top-k K={k} must be in 1..{min(e, MAX_TOP_K)} (<= E and <= {MAX_TOP_K})")
    for name, v in (("hidden H", h), ("intermediate I", i)):
        if v < DIM_MULTIPLE or v % DIM_MULTIPLE:
            raise ValueError(f"--shape {text!r}: {name}={v} must be a positive multiple of {DIM_MULTIPLE}")
    return MoEShape(f"E={e} top-{k} H={h} I={i}", experts=e, top_k=k, hidden=h, intermediate=i)


def _random_spec(name: str) -> tuple[int, int]:
    """'random:N' or 'random:N:SEED' -> (N, SEED); ValueError naming the spec."""
    from ..zoo import RANDOM_SEED

    parts = name.split(":")[1:]
    try:
        count, seed = int(parts[0]), int(parts[1]) if len(parts) == 2 else RANDOM_SEED
    except (ValueError, IndexError):
        count = seed = -1
    if len(parts) > 2 or count < 1 or seed < 0:
        raise ValueError(
            f"--models {name!r}: give random:N or random:N:SEED, N >= 1 layers and SEED >= 0 "
            f"(random:16 draws seed {RANDOM_SEED}'s first 16)"
        )
    return count, seed


def resolve_models(spec: str) -> dict[str, MoEShape]:
    """--models -> {key: shape}, in the order given (see --help); ValueError for a name the zoo lacks."""
    from ..zoo import MODELS, ZooShape, random_models, zoo_shape, zoo_shapes

    zoo = {s.key: s for s in zoo_shapes()}
    out: dict[str, MoEShape] = {}
    for name in (m.strip().lower() for m in spec.split(",") if m.strip()):
        if name.startswith("random:"):
            for model in random_models(*_random_spec(name)):
                out[model.key] = MoEShape.from_zoo(ZooShape(model))
            continue
        keys = (
            list(zoo)
            if name == "zoo"
            else [k for k, s in zoo.items() if s.tp == s.ep == 1]
            if name == "zoo-models"
            else [ALIASES.get(name, name)]
        )
        for key in keys:
            if key == "tiny":
                out[key] = TINY
            elif key in zoo:
                out[key] = MoEShape.from_zoo(zoo[key])
            elif key.startswith("random-s"):
                out[key] = MoEShape.from_zoo(zoo_shape(key))
            else:
                raise ValueError(
                    f"unknown model {name!r}; choose a zoo model ({', '.join(m.key for m in MODELS)}), "
                    "a per-rank key such as kimi-k2-ep8 or glm-4.5-tp4, zoo, zoo-models, random:N[:SEED], "
                    f"a random layer's key (random-s0-03), tiny, {', '.join(ALIASES)}, or give --shape "
                    "E,K,H,I"
                )
    return out


def _token_counts(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tokens {text!r}: give a comma list of integers, e.g. 1,16,256") from None
    if not tokens or any(t < 1 for t in tokens):
        raise ValueError(f"--tokens {text!r}: token counts must be >= 1")
    return tokens


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed strings -> models {key: MoEShape}, path and token lists, the --quick and CPU defaults; ValueError
    naming the argument that is wrong."""
    cpu = args.device == "cpu"
    models = resolve_models(args.models) if args.models else {}
    if args.shape:
        shape = parse_shape(args.shape)
        models[f"{shape.experts},{shape.top_k},{shape.hidden},{shape.intermediate}"] = shape
    args.models = models or resolve_models(CPU_MODEL if cpu else args.default_models)
    spec = args.paths.strip().lower()
    args.paths = (
        available_paths(args.device)
        if spec == "auto"
        else list(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    )
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        raise ValueError(f"--paths {spec!r}: unknown {unknown}; choose from {list(PATHS)} or auto")
    default_tokens = CPU_TOKENS if cpu and not args.quick else QUICK_TOKENS if args.quick else TOKENS
    tokens = _token_counts(args.tokens) if args.tokens else list(default_tokens)
    args.tokens = [t for t in tokens if t >= args.min_tokens]
    if not args.tokens:
        raise ValueError(f"--min-tokens {args.min_tokens}: leaves none of the token counts {tokens}")
    args.replays = args.replays or (5 if args.quick or cpu else 10)
    args.rounds = args.rounds or (1 if args.quick or cpu else 3)
    args.target_graph_ms = args.target_graph_ms or (10.0 if args.quick else 20.0)
    return args


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """``parser`` (build_parser()'s by default) parses and finish_args completes; bad input exits as argparse's do."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        return finish_args(args)
    except ValueError as exc:
        parser.error(str(exc))


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def random_meta(models: dict[str, MoEShape]) -> dict | None:
    """The random layers among ``models``: their seeds, the bounds they were drawn in, their shapes; None without."""
    from ..zoo import RANDOM_BOUNDS, RANDOM_SEED

    drawn = {key: s for key, s in models.items() if key.startswith("random-s")}
    if not drawn:
        return None
    layers = [
        dict(key=key, experts=s.experts, top_k=s.top_k, hidden=s.hidden, inter=s.intermediate)
        for key, s in drawn.items()
    ]
    seeds = sorted({int(key.split("-")[1][1:]) for key in drawn})
    return {"seeds": seeds, "default_seed": RANDOM_SEED, "bounds": asdict(RANDOM_BOUNDS), "layers": layers}


def device_meta(args: argparse.Namespace) -> dict:
    """environment() for this run, and on the CPU what ran there instead of the GPU's fields."""
    import torch

    from ..dispatch import select_backends

    meta = environment(extra_modules=("vllm",))
    meta["humming_kernels"] = package_version("humming-kernels")
    meta["device_kind"] = args.device
    backend = select_backends(torch.device(args.device)).moe_w4a16
    meta["ours_backend"], meta["ours_reference"] = backend.name, backend.reference
    if args.device == "cpu":  # a GPU beside the CPU run is not what ran
        for key in ("device", "capability", "sm_count", "memory_gib", "l2_bytes"):
            meta.pop(key, None)
        meta["cpu"] = platform.processor() or platform.machine()
        meta["cpu_threads"] = torch.get_num_threads()
    return meta


def measure_meta(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[dict, Ceilings]:
    """The run's meta before any row: device, versions, ceilings, policies, arguments, random layers."""
    import torch

    from ..shapes import device_traits
    from ..sm90 import tuned_configs

    start = time.time()
    meta = device_meta(args)
    log(
        f"bench on {meta.get('device', 'the CPU')}: torch {meta['torch']} triton {meta['triton']} vllm {meta['vllm']} "
        f"humming-kernels {meta['humming_kernels']}; paths {','.join(args.paths)}"
    )
    ceilings = measure_ceilings(quick=args.quick or args.device == "cpu", device=args.device)
    meta["ceilings"] = {
        "copy_GBps": ceilings.copy_bytes_per_s / 1e9,
        "bf16_TFLOPs": ceilings.bf16_flops_per_s / 1e12,
        "copy": ceilings.copy_detail,
        "matmul": ceilings.matmul_detail,
    }
    log(
        f"ceilings: copy {meta['ceilings']['copy_GBps']:.0f} GB/s, bf16 mm {meta['ceilings']['bf16_TFLOPs']:.0f} "
        f"TFLOP/s ({time.time() - start:.1f} s)"
    )
    meta["l2_policy"] = (
        "one weight copy (--no-rotate)"
        if args.no_rotate
        else f"rotating weight copies: each captured call uses the next copy, n = ceil({args.l2_factor:g} x L2 / touched "
        f"weight bytes) (max {args.max_copies}), so >= {args.l2_factor:g} x L2 of other weights stream between reuses"
    )
    meta["rounds"] = args.rounds
    meta["floor"] = (
        "floor_us = max(hbm_floor_us, compute_floor_us); hbm = (touched experts' NVFP4 weights + e4m3 scales "
        "+ fp32 global scales + x read + out write) / copy bandwidth; compute = 2*T*k*3*I*H / bf16 rate"
    )
    meta["rel_tol"] = args.tol
    meta["args"] = {k: v for k, v in vars(args).items() if k != "models" and not callable(v)} | {
        "models": list(args.models)
    }
    meta["config_dir"] = str(tuned_configs.CONFIG_DIR)
    tuned_file = tuned_configs.tuned_file_for(device_traits(torch.device("cuda"))) if args.device == "cuda" else None
    meta["tuned_file"] = str(tuned_file) if tuned_file else None  # serves this GPU; whether it served a row: below
    meta["autotune"] = args.autotune
    meta["random"] = random_meta(args.models)
    for layer in (meta["random"] or {}).get("layers", []):
        log(
            f"random layer {layer['key']}: E={layer['experts']} top-{layer['top_k']} H={layer['hidden']} "
            f"I={layer['inter']}"
        )
    return meta, ceilings


def measure(args: argparse.Namespace, log: Callable[[str], None] = log) -> tuple[dict, list[dict]]:
    """Every row of ``args`` (finish_args'): the ceilings, then each model's rows; returns (meta, rows)."""
    quiet_vllm()
    import torch

    start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    meta, ceilings = measure_meta(args, log)
    l2 = meta.get("l2_bytes") or 50 * 2**20
    deadline = start + args.time_budget_s
    rows: list[dict] = []
    for key, shape in args.models.items():
        try:
            rows += run_model(key, shape, args.tokens, args, ceilings, l2, deadline, log)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory while building weights
            log(f"   {shape.name} FAILED: {short_error(exc)}")
            traceback.print_exc()
            rows.append({"model": shape.name, "status": f"failed: {short_error(exc)}"})
            empty_cache()
    meta.update(configs_meta(rows))
    meta["prefill"] = prefill_summary(rows)
    meta["wall_s"] = time.time() - start
    return meta, rows


def run(args: argparse.Namespace, log: Callable[[str], None] = log) -> list[dict]:
    """Measure ``args`` (finish_args'), print the report, write ``args.out`` when given; returns the rows."""
    meta, rows = measure(args, log)
    log(stdout_report(args, meta, rows))
    if args.out:
        log(f"wrote {', '.join(write_reports(args.out, args, meta, rows))}; total {meta['wall_s']:.0f} s")
    return rows
