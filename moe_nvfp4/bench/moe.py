"""NVFP4 MoE forward: ours vs vLLM 0.26 Marlin NVFP4 (and Humming NVFP4) vs vLLM Triton BF16 (or torch BF16),
against measured floors.  ``moe-nvfp4 bench`` runs it; so does the repository's ``benchmarks/bench_moe.py``.

    moe-nvfp4 bench                                          # Qwen3-30B-A3B, the paths this machine has
    moe-nvfp4 bench --model mixtral-8x7b --tokens 1,64 --out mixtral.json
    moe-nvfp4 bench --shape 64,8,2048,1024 --paths ours,bf16 --out layer.md
    python benchmarks/bench_moe.py --models zoo --out benchmarks/results/zoo/ranks   # the lab's runs

One process, one GPU.  For each model and token count T: random bf16 x and router logits, softmax
top-k (renormalized), random bf16 expert weights quantized once to NVFP4 (one global scale per expert
and matrix, as vLLM's ModelOpt path uses for w13); all the paths (``moe_nvfp4.bench.paths``) compute the same
function on the same dequantized weights.  Outputs are checked against each other (and a float32 torch reference)
before timing; timing is CUDA graph replay with rotating weight copies so L2 never holds the weights between calls
(``moe_nvfp4.bench.harness``).  vLLM is imported only by the paths that use it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
import traceback
from typing import Any, Callable

from .harness import (
    Ceilings,
    MoEShape,
    Timing,
    environment,
    floors,
    format_value,
    markdown_table,
    measure_ceilings,
    pct_of_floor,
    ratio,
    rotation_copies,
    sync,
    time_eager,
    time_with_fallback,
    write_json,
    write_markdown,
)
from .paths import PATHS, Path, build_path, short_error

# --models: zoo shape keys (moe_nvfp4.zoo), "zoo" (every shape), "zoo-models" (every model at TP=1), the two
# shapes the bench always had by their short names, and a smoke shape for checking the bench itself
# (e.g. --device cpu --models tiny).
ALIASES = {"mixtral": "mixtral-8x7b", "qwen3": "qwen3-30b-a3b"}
TINY = MoEShape("tiny", num_experts=4, top_k=2, hidden=128, inter=64, renormalize=True)
DEFAULT_MODEL = "qwen3-30b-a3b"
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_TOKENS = (1, 64, 1024)
BASELINES = ("marlin", "humming", "bf16", "torch")  # the paths ours is compared with, row by row
REL_TOL = 2e-2  # same dequantized weights everywhere; only bf16 rounding/accumulation order differ
# api.fused_moe's limits, which an explicit --shape must meet
MAX_EXPERTS, MAX_TOP_K, DIM_MULTIPLE = 1024, 16, 16

COLUMNS = [
    ("model", "model", ""),
    ("config_source", "config", ""),
    ("tokens", "T", "d"),
    ("touched_experts", "touched", "d"),
    ("ours_us", "ours µs", ".1f"),
    ("marlin_us", "Marlin µs", ".1f"),
    ("humming_us", "Humming µs", ".1f"),
    ("bf16_us", "BF16 µs", ".1f"),
    ("torch_us", "torch µs", ".1f"),
    ("floor_us", "floor µs", ".1f"),
    ("bound", "bound", ""),
    ("pct_of_floor", "ours % floor", ".0f"),
    ("marlin_pct_of_floor", "Marlin % floor", ".0f"),
    ("humming_pct_of_floor", "Humming % floor", ".0f"),
    ("speedup_vs_marlin", "× Marlin", ".2f"),
    ("speedup_vs_humming", "× Humming", ".2f"),
    ("speedup_vs_bf16", "× BF16", ".2f"),
    ("speedup_vs_torch", "× torch", ".2f"),
    ("rel_err_ours", "err ours", ".1e"),
    ("rel_err_marlin", "err Marlin", ".1e"),
    ("rel_err_humming", "err Humming", ".1e"),
    ("status", "status", ""),
]


def columns(paths: list[str]) -> list[tuple[str, str, str]]:
    """COLUMNS less the time, % floor, speedup and error columns of the paths not run."""
    own = {p: {f"{p}_us", f"{p}_pct_of_floor", f"speedup_vs_{p}", f"rel_err_{p}"} for p in PATHS}
    dropped = set().union(*(own[p] for p in PATHS if p not in paths))
    return [c for c in COLUMNS if c[0] not in dropped]


def add_ratios(row: dict) -> None:
    """% of floor for every path and ours' speedup over each baseline, from the row's times (None where one is
    missing)."""
    ours = row.get("ours_us")
    row["pct_of_floor"] = pct_of_floor(row["floor_us"], ours)
    for name in BASELINES:
        row[f"{name}_pct_of_floor"] = pct_of_floor(row["floor_us"], row.get(f"{name}_us"))
        row[f"speedup_vs_{name}"] = ratio(row.get(f"{name}_us"), ours)


def quiet_vllm() -> None:
    """Keep vLLM's INFO lines out of the output: set before vLLM is first imported (the user's setting wins)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def log(msg: str) -> None:
    print(msg, flush=True)


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(a, b) -> float:
    import torch

    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def available_paths() -> list[str]:
    """The paths this machine's packages can build: ours; vLLM's Marlin and BF16 where vLLM is installed, Humming
    where humming-kernels is too; the torch BF16 loop where vLLM is not (so a row always has a baseline).  Looked
    up, not imported: a path whose package fails to import reports that in its rows."""
    has = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731
    if not has("vllm"):
        return ["ours", "torch"]
    return ["ours", "marlin", *(["humming"] if has("humming") else []), "bf16"]


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------
WEIGHT_CHUNK_BYTES = 2 << 30  # bf16 experts drawn and quantized this many bytes at a time (Kimi-K2: 34 GB in all)


def make_weights(shape: MoEShape, seed: int, device: str):
    """Random bf16 experts (std 1/sqrt(K)), NVFP4-quantized a few experts at a time; returns (w13_q, w2_q,
    w13_deq, w2_deq), the last two None where the dequantized BF16 layer does not fit in half the free memory
    (the BF16 path and the float reference then drop out of that model's rows)."""
    import torch

    from ..formats import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    step = max(1, WEIGHT_CHUNK_BYTES // shape.expert_bf16_bytes())

    def draw(n: int, k: int) -> NVFP4Tensor:
        parts = []
        for first in range(0, e, step):
            w = torch.randn(min(step, e - first), n, k, device=device, dtype=torch.bfloat16, generator=gen) * (k**-0.5)
            parts.append(quantize_nvfp4(w))  # one global scale per expert and matrix: vLLM's Marlin path keeps one
            del w
        return NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("packed", "block_scale", "global_scale")))

    w13_q, w2_q = draw(shape.w13_rows, h), draw(h, i)
    empty_cache()
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 40
    if e * shape.expert_bf16_bytes() > free // 2:
        return w13_q, w2_q, None, None

    def dequantized(q: NVFP4Tensor) -> torch.Tensor:  # the same experts at a time: its float32 temporaries too
        return torch.cat([dequantize_nvfp4(NVFP4Tensor(q.packed[a : a + step], q.block_scale[a : a + step],
                                                       q.global_scale[a : a + step]), torch.bfloat16)
                          for a in range(0, e, step)])  # fmt: skip

    w13_deq, w2_deq = dequantized(w13_q), dequantized(w2_q)
    empty_cache()
    return w13_q, w2_q, w13_deq, w2_deq


def make_inputs(shape: MoEShape, tokens: int, seed: int, device: str):
    """x, softmax top-k routing over the routing's experts, and under expert parallelism the expert map of the
    rank that holds the first num_experts of them (None without)."""
    import torch

    from ..routing import topk_softmax

    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + tokens)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, shape.routed_experts, device=device, dtype=torch.float32, generator=gen)
    topk_weights, topk_ids = topk_softmax(logits, shape.top_k, renormalize=shape.renormalize)
    expert_map = None
    if shape.routed_experts != shape.num_experts:
        expert_map = torch.full((shape.routed_experts,), -1, dtype=torch.int32, device=device)
        expert_map[: shape.num_experts] = torch.arange(shape.num_experts, dtype=torch.int32, device=device)
    return x, topk_weights.contiguous(), topk_ids.contiguous(), expert_map


def expert_bytes(shape: MoEShape, path: str) -> int:
    """One expert's weight bytes as ``path`` holds them: bf16 for the BF16 and torch paths, NVFP4 for the others."""
    return shape.expert_bf16_bytes() if path in ("bf16", "torch") else shape.expert_nvfp4_bytes()


def copies_for(shape: MoEShape, tokens: list[int], path: str, args, l2: int) -> int:
    """Copies of ``path``'s weights needed at the smallest T (the fewest touched experts), capped by max and by
    memory."""
    import torch

    if args.no_rotate:
        return 1
    per_expert = expert_bytes(shape, path)
    touched = shape.max_touched(min(tokens))
    want = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=args.max_copies)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 8 << 30
    by_memory = max(1, int(0.15 * free // max(per_expert * shape.num_experts, 1)))
    return max(1, min(want, by_memory))


def repro_command(args, key: str, tokens: int) -> str:
    """The command that reruns one row: this bench's command, its shape (a --shape key is E,K,H,I) and T."""
    shape = f"--shape {key}" if key[0].isdigit() else f"--models {key}"
    return f"{args.repro_command} {shape} --tokens {tokens}"


def time_path(path: Path, fns: list[Callable[[], Any]], args) -> Timing:
    """CUDA graph replay of ``fns`` in turn (eager, marked, where capture fails); eager for a path that reads
    its routing on the host, which no graph can hold."""
    if not path.graphable:
        return time_eager(fns, iters=args.replays * 2, note="reads its routing on the host")
    return time_with_fallback(fns, target_graph_ms=args.target_graph_ms, replays=args.replays,
                              max_calls=args.max_calls)  # fmt: skip


def run_model(
    key: str, shape: MoEShape, tokens: list[int], args, ceilings: Ceilings, l2: int, deadline: float,
    log: Callable[[str], None] = log,
) -> list[dict]:
    """The rows of one shape, a row per token count (see the module docstring); ``log`` gets the progress lines."""
    import torch

    from ..configs import LayerShape, device_traits, entries_for, measured_entries, select_config
    from ..reference import moe_dense_torch

    rows: list[dict] = []
    t0 = time.time()
    ep = f" of {shape.routed_experts} (expert parallel)" if shape.routed_experts != shape.num_experts else ""
    log(f"\n== {shape.name}: E={shape.num_experts}{ep} top-{shape.top_k} H={shape.hidden} I={shape.inter}")
    w13_q, w2_q, w13_deq, w2_deq = make_weights(shape, args.seed, args.device)
    log(f"   weights quantized in {time.time() - t0:.1f} s")

    fp4_expert = shape.expert_nvfp4_bytes()
    paths: dict[str, Path | None] = {}
    errors: dict[str, str] = {}
    for name in args.paths:
        n = copies_for(shape, tokens, name, args, l2)
        t1 = time.time()
        try:
            paths[name] = build_path(name, shape, (w13_q, w2_q, w13_deq, w2_deq), n)
            copies = len(paths[name].weights)
            log(f"   {name:7s} ready: {copies} weight cop{'y' if copies == 1 else 'ies'} ({time.time() - t1:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - one path failing must not stop the others
            paths[name] = None
            errors[name] = f"setup: {short_error(exc)}"
            log(f"   {name:7s} SETUP FAILED: {short_error(exc)}")
            if args.verbose:
                traceback.print_exc()
        sync()
    layer = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.inter, "bfloat16", shape.routed_experts,
                       shape.expert_activation.gated)  # fmt: skip
    autotuned = None
    if args.autotune and paths.get("ours") is not None and args.device == "cuda":
        from ..autotune import autotune_fused_moe

        _, _, _, emap = make_inputs(shape, 1, args.seed, args.device)
        report = autotune_fused_moe(paths["ours"].weights[0], shape.top_k, torch.bfloat16, max(tokens), expert_map=emap,
                                    budget_s=args.autotune_budget_s)  # fmt: skip
        autotuned = dict(seconds=round(report.seconds, 1), source=report.source, summary=report.summary())
        log(f"   autotune: {report.summary()}")

    for t in tokens:
        row: dict[str, Any] = {
            "model": shape.name,
            "tokens": t,
            "num_experts": shape.num_experts,
            "global_experts": shape.routed_experts,
            "top_k": shape.top_k,
            "hidden": shape.hidden,
            "inter": shape.inter,
            "activation": shape.activation,
            "repro": repro_command(args, key, t),
        }
        if autotuned is not None:
            row["autotune"] = autotuned
        notes: list[str] = []
        if time.time() > deadline:
            row["status"] = "skipped (time budget)"
            rows.append(row)
            log(f"   T={t:5d} skipped: time budget reached")
            continue
        x, topk_weights, topk_ids, expert_map = make_inputs(shape, t, args.seed, args.device)
        local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
        touched = int(torch.unique(local[local >= 0]).numel())
        nbytes = shape.hbm_bytes(t, touched)
        flops = shape.flops(t)
        row.update(touched_experts=touched, hbm_bytes=nbytes, weight_bytes=touched * fp4_expert, flops=flops)
        row.update(floors(nbytes, flops, ceilings))
        if x.is_cuda:  # the config ours runs at this T and where it came from, so a row can be traced to it
            traits = device_traits(x.device)
            row["ours_config"] = select_config(t, layer, traits).to_dict()
            row["config_source"] = ("autotuned" if measured_entries(layer, traits) else
                                    "tuned" if entries_for(layer, traits) else "default")  # fmt: skip

        # Correctness: every path once, eagerly, against the float32 torch reference on the same weights.
        outs: dict[str, torch.Tensor] = {}
        ref = None
        if not args.no_ref and w13_deq is not None:
            try:
                ref = moe_dense_torch(x.float(), w13_deq, w2_deq, topk_weights, topk_ids, expert_map=expert_map,
                                      activation=shape.expert_activation, compute_dtype=torch.float32)  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                notes.append(f"ref: {short_error(exc)}")
        for name in args.paths:
            p = paths.get(name)
            if p is None:
                notes.append(f"{name} {errors.get(name, 'unavailable')}")
                continue
            try:
                outs[name] = p.fn(0, x, topk_weights, topk_ids, expert_map)().float()
                sync()
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name} run: {short_error(exc)}")
                if args.verbose:
                    traceback.print_exc()
        # rel_err_<path>: vs the BF16 path, else the reference, else (no BF16 weights) vs Marlin
        base, basis = next(((out, name) for out, name in ((outs.get("bf16"), "bf16"), (ref, "ref"),
                                                          (outs.get("marlin"), "marlin")) if out is not None), (None, None))
        row["err_basis"] = basis
        for name in ("ours", "marlin", "humming"):
            if name in outs and name != basis:
                row[f"rel_err_{name}"] = rel_err(outs[name], base) if base is not None else None
        for name, out in outs.items():
            row[f"rel_err_{name}_vs_ref"] = rel_err(out, ref) if ref is not None else None
        for name in ("marlin", "humming"):
            if "ours" in outs and name in outs:
                row[f"rel_err_ours_vs_{name}"] = rel_err(outs["ours"], outs[name])
        mismatches = []
        for name in outs:
            err = row.get(f"rel_err_{name}") if name != "bf16" else None
            if err is None:
                err = row.get(f"rel_err_{name}_vs_ref")
            if err is not None and not err <= args.tol:  # also catches NaN
                mismatches.append(f"{name}={err:.1e}")
        if mismatches:
            notes.append("MISMATCH " + ",".join(mismatches))
        del outs, ref

        # Timing: graph replay over rotating weight copies; eager (marked) when capture fails.  The paths take turns
        # for args.rounds rounds, each path's time its median round: the SM clock moves with the GPU's
        # power state (a sustained forward may sit at the power cap), and in turns every path sees the same mix.
        fns_of: dict[str, list] = {}
        for name in args.paths:
            p = paths.get(name)
            if p is None or any(n.startswith(f"{name} run") for n in notes):
                row[f"{name}_us"] = None
                continue
            per_expert = expert_bytes(shape, name)
            n_rot = 1 if args.no_rotate else rotation_copies(touched * per_expert, l2, factor=args.l2_factor,
                                                           max_copies=len(p.weights))
            fns_of[name] = [p.fn(c, x, topk_weights, topk_ids, expert_map) for c in range(n_rot)]
            needed = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=10**6)
            if not args.no_rotate and n_rot < needed:
                notes.append(f"{name} rotates {n_rot}/{needed} copies (L2 may be warm)")
        rounds: dict[str, list[Timing]] = {name: [] for name in fns_of}
        for _ in range(args.rounds):
            for name in [n for n in fns_of if n in rounds]:
                try:
                    rounds[name].append(time_path(paths[name], fns_of[name], args))
                except Exception as exc:  # noqa: BLE001
                    del rounds[name]
                    row[f"{name}_us"] = None
                    notes.append(f"{name} timing: {short_error(exc)}")
                    if args.verbose:
                        traceback.print_exc()
                finally:
                    sync()
        for name, timings in rounds.items():
            middle = sorted(timings, key=lambda t: t.median_us)[len(timings) // 2]  # of two, the slower
            row[f"{name}_us"] = middle.median_us
            row[f"{name}_timing"] = dict(middle.as_dict(), rounds_us=[t.median_us for t in timings])
            if middle.method != "graph" and paths[name].graphable:
                notes.append(f"{name} eager ({middle.note})")
        del fns_of
        add_ratios(row)
        row["status"] = "ok" if not notes else "; ".join(notes)
        row["notes"] = notes
        rows.append(row)
        times = " ".join(f"{name}={format_value(row.get(f'{name}_us'))}" for name in args.paths)
        errs = " ".join(f"{name}={format_value(row.get(f'rel_err_{name}'), '.1e')}" for name in args.paths
                        if name not in ("bf16", "torch"))
        log(
            f"   T={t:5d} touched={touched:3d} {times} "
            f"floor={row['floor_us']:.1f}us ({row['bound']}) ours%floor={format_value(row['pct_of_floor'], '.0f')} "
            f"err {errs}" + (f"  [{_clip(row['status'], 300)}]" if notes else "")
        )
        del x, topk_weights, topk_ids, expert_map

    del paths, w13_q, w2_q, w13_deq, w2_deq
    empty_cache()
    log(f"   {shape.name} done in {time.time() - t0:.1f} s")
    return rows


def _clip(text: Any, n: int) -> Any:
    return text if not isinstance(text, str) or len(text) <= n else text[: n - 3] + "..."


# --------------------------------------------------------------------------------------------------
# Command line: ``moe-nvfp4 bench`` and benchmarks/bench_moe.py (which changes the defaults: set_defaults)
# --------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, *, default_models: str = DEFAULT_MODEL) -> None:
    """The bench's options on ``p``; ``default_models`` run when neither --models nor --shape is given."""
    p.add_argument("--models", "--model", default=None,
                   help=f"comma list of zoo shape keys (e.g. {DEFAULT_MODEL}, kimi-k2-ep8, glm-4.5-tp4), 'zoo' (every "
                        f"shape), 'zoo-models' (each model at TP=1), or mixtral, qwen3, tiny (default {default_models}; "
                        "none with --shape)")
    p.add_argument("--shape", default=None, metavar="E,K,H,I",
                   help="a layer of your own: experts, top-k, hidden and intermediate sizes (H, I multiples of 16)")
    p.add_argument("--tokens", default=None,
                   help=f"comma list of token counts (default {','.join(map(str, TOKENS))}; "
                        f"--quick {','.join(map(str, QUICK_TOKENS))})")
    p.add_argument("--paths", default="auto",
                   help=f"comma list of {', '.join(PATHS)}, or auto: ours, with vLLM its marlin, bf16 (and humming "
                        "where humming-kernels is installed: its first forward per shape JIT-compiles, ~20-30 s), "
                        "without vLLM torch")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="also write the results: FILE.json (rows and meta), FILE.md (report), or a directory "
                        "(moe.json and moe.md)")
    p.add_argument("--autotune", action="store_true",
                   help="autotune each shape's configs first (moe_nvfp4.autotune, its on-disk cache included)")
    p.add_argument("--autotune-budget-s", type=float, default=50.0, help="the autotuner's search budget per shape")
    p.add_argument("--quick", action="store_true", help="fewer token counts, replays and ceiling iterations")
    p.add_argument("--replays", type=int, default=None, help="graph replays per measurement (default 10; quick 5)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurements per path, the paths in turn; the row takes their median (default 3; quick 1)")
    p.add_argument("--target-graph-ms", type=float, default=None,
                   help="calls per graph sized to this (default 20; quick 10)")
    p.add_argument("--max-calls", type=int, default=400, help="upper bound on calls captured per graph")
    p.add_argument("--l2-factor", type=float, default=4.0,
                   help="rotate weight copies until this many L2 sizes stream between reuses")
    p.add_argument("--max-copies", type=int, default=16, help="most weight copies per path (memory)")
    p.add_argument("--no-rotate", action="store_true", help="one weight copy (L2 may stay warm for tiny T)")
    p.add_argument("--no-ref", action="store_true", help="skip the float32 torch reference check")
    p.add_argument("--tol", type=float, default=REL_TOL, help="relative-error bound vs the BF16 path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=420.0, help="skip remaining rows after this many seconds")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the bench itself (torch reference for ours, host clock, no graphs)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing paths")
    # not options: the models run when neither --models nor --shape is given, and the command a row's repro names
    p.set_defaults(default_models=default_models, repro_command="moe-nvfp4 bench")


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
        raise ValueError(f"--shape {text!r}: give four integers E,K,H,I (experts, top-k, hidden, intermediate), "
                         "e.g. 128,8,2048,768") from None  # fmt: skip
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"--shape {text!r}: experts E={e} must be in 1..{MAX_EXPERTS}")
    if not 1 <= k <= min(e, MAX_TOP_K):
        raise ValueError(f"--shape {text!r}: top-k K={k} must be in 1..{min(e, MAX_TOP_K)} (<= E and <= {MAX_TOP_K})")
    for name, v in (("hidden H", h), ("intermediate I", i)):
        if v < DIM_MULTIPLE or v % DIM_MULTIPLE:
            raise ValueError(f"--shape {text!r}: {name}={v} must be a positive multiple of {DIM_MULTIPLE}")
    return MoEShape(f"E={e} top-{k} H={h} I={i}", num_experts=e, top_k=k, hidden=h, inter=i)


def resolve_models(spec: str) -> dict[str, MoEShape]:
    """--models -> {key: shape}, in the order given (see --help); ValueError for a name the zoo lacks."""
    from ..zoo import MODELS, zoo_shapes

    zoo = {s.key: s for s in zoo_shapes()}
    out: dict[str, MoEShape] = {}
    for name in (m.strip().lower() for m in spec.split(",") if m.strip()):
        keys = (list(zoo) if name == "zoo" else [k for k, s in zoo.items() if s.tp == s.ep == 1]
                if name == "zoo-models" else [ALIASES.get(name, name)])  # fmt: skip
        for key in keys:
            if key == "tiny":
                out[key] = TINY
            elif key in zoo:
                out[key] = MoEShape.from_zoo(zoo[key])
            else:
                raise ValueError(f"unknown model {name!r}; choose a zoo model ({', '.join(m.key for m in MODELS)}), "
                                 "a per-rank key such as kimi-k2-ep8 or glm-4.5-tp4, zoo, zoo-models, tiny, "
                                 f"{', '.join(ALIASES)}, or give --shape E,K,H,I")  # fmt: skip
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
    """The parsed strings -> models {key: MoEShape}, path and token lists, the --quick defaults; ValueError naming
    the argument that is wrong."""
    models = resolve_models(args.models) if args.models else {}
    if args.shape:
        shape = parse_shape(args.shape)
        models[f"{shape.num_experts},{shape.top_k},{shape.hidden},{shape.inter}"] = shape
    args.models = models or resolve_models(args.default_models)
    spec = args.paths.strip().lower()
    args.paths = available_paths() if spec == "auto" else list(dict.fromkeys(p.strip() for p in spec.split(",")
                                                                             if p.strip()))  # fmt: skip
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        raise ValueError(f"--paths {spec!r}: unknown {unknown}; choose from {list(PATHS)} or auto")
    args.tokens = _token_counts(args.tokens) if args.tokens else list(QUICK_TOKENS if args.quick else TOKENS)
    args.replays = args.replays or (5 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
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


def model_summaries(rows: list[dict]) -> list[str]:
    """One line per model: min / median speedup vs each baseline and % of floor over its timed rows."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        parts = []
        for col, label in (("speedup_vs_marlin", "x Marlin"), ("speedup_vs_humming", "x Humming"),
                           ("speedup_vs_bf16", "x BF16"), ("speedup_vs_torch", "x torch"), ("pct_of_floor", "% floor")):
            values = sorted(r[col] for r in mine if r.get(col) is not None)
            if values:
                parts.append(f"{label} min {values[0]:.2f} median {statistics.median(values):.2f}")
        sources = sorted({r["config_source"] for r in mine if r.get("config_source")})
        out.append(f"{model} ({'/'.join(sources) or 'no config'}): " + ("; ".join(parts) or "no timed rows"))
    return out


def summary_lines(meta: dict) -> list[str]:
    c = meta["ceilings"]
    return [
        f"device: {meta.get('device')} (sm_{str(meta.get('capability', '')).replace('.', '')}), "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, vllm {meta.get('vllm')}",
        f"copy bandwidth {c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s "
        f"({c['matmul'].get('n')}^3, cuBLAS)",
        f"command: `{meta['command']}`; {meta['date']}; commit {meta.get('git_commit')}"
        + (" (dirty)" if meta.get("git_dirty") else ""),
        f"timing: CUDA graph replay, median per call; {meta.get('rounds', 1)} rounds, the paths in turn, each row the "
        f"median round; L2: {meta['l2_policy']}",
        f"configs: tuned entries {'used where a file serves this GPU' if meta.get('tuned_entries') else 'none'} "
        f"(MOE_NVFP4_CONFIG_DIR={meta.get('config_dir')}); autotuning {'ran' if meta.get('autotune') else 'off'}",
    ]


def measure(args: argparse.Namespace, log: Callable[[str], None] = log) -> tuple[dict, list[dict]]:
    """Every row of ``args`` (finish_args'): the ceilings, then each model's rows; returns (meta, rows)."""
    quiet_vllm()
    import torch

    start = time.time()
    deadline = start + args.time_budget_s
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = environment(extra_modules=("vllm",))
    l2 = meta.get("l2_bytes") or 50 * 2**20
    log(f"bench on {meta.get('device', 'cpu')}: torch {meta['torch']} triton {meta['triton']} vllm {meta['vllm']}; "
        f"L2 {l2 / 2**20:.0f} MiB; paths {','.join(args.paths)}")
    ceilings = measure_ceilings(quick=args.quick, device=args.device)
    meta["ceilings"] = {
        "copy_GBps": ceilings.copy_bytes_per_s / 1e9,
        "bf16_TFLOPs": ceilings.bf16_flops_per_s / 1e12,
        "copy": ceilings.copy_detail,
        "matmul": ceilings.matmul_detail,
    }
    log(f"ceilings: copy {meta['ceilings']['copy_GBps']:.0f} GB/s, "
        f"bf16 mm {meta['ceilings']['bf16_TFLOPs']:.0f} TFLOP/s "
        f"({time.time() - start:.1f} s)")
    meta["l2_policy"] = (
        "one weight copy (--no-rotate)" if args.no_rotate else
        f"rotating weight copies: each captured call uses the next copy, n = ceil({args.l2_factor:g} x L2 / touched "
        f"weight bytes) (max {args.max_copies}), so >= {args.l2_factor:g} x L2 of other weights stream between reuses"
    )
    meta["rounds"] = args.rounds
    meta["floor"] = (
        "floor_us = max(hbm_floor_us, compute_floor_us); hbm = (touched experts' NVFP4 weights + e4m3 scales "
        "+ fp32 global scales + x read + out write) / copy bandwidth; compute = 2*T*k*3*I*H / bf16 rate"
    )
    meta["rel_tol"] = args.tol
    meta["args"] = {k: v for k, v in vars(args).items() if k != "models" and not callable(v)} | {
        "models": list(args.models)}  # fmt: skip
    from .. import configs

    meta["config_dir"] = str(configs.CONFIG_DIR)
    meta["tuned_entries"] = args.device == "cuda" and configs.tuned_file_for(configs.device_traits(
        torch.device("cuda"))) is not None  # fmt: skip
    meta["autotune"] = args.autotune

    rows: list[dict] = []
    for key, shape in args.models.items():
        try:
            rows += run_model(key, shape, args.tokens, args, ceilings, l2, deadline, log)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory while building weights
            log(f"   {shape.name} FAILED: {short_error(exc)}")
            traceback.print_exc()
            rows.append({"model": shape.name, "status": f"failed: {short_error(exc)}"})
            empty_cache()
    meta["wall_s"] = time.time() - start
    return meta, rows


def report_notes(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    """What the Markdown report says under its table: the columns, how to rerun a row, a line per model."""
    return [
        "Columns: times are µs per MoE forward (see timing above); floor = max(HBM, compute) floor; "
        "% floor = floor / time (100 = at the floor); × = baseline time / our time; err = ||a - b|| / ||b|| vs the "
        "vLLM BF16 path on the same dequantized weights (vs the float32 torch reference without it).",
        "",
        f"Repro: `{args.repro_command} --models <shape key> --tokens <T>` (each row's `repro` in the JSON).",
        "",
        "Per model (config: where ours' configs came from):",
        "",
        *[f"- {line}" for line in model_summaries(rows)],
    ]


def write_reports(out: str, args: argparse.Namespace, meta: dict, rows: list[dict]) -> list[str]:
    """``out``: a .json file (meta and rows), a .md file (summary, table, notes), or a directory (moe.json and
    moe.md in it); returns the files written."""
    if out.endswith(".json"):
        targets = {"json": out}
    elif out.endswith(".md"):
        targets = {"md": out}
    else:
        os.makedirs(out, exist_ok=True)
        targets = {"json": os.path.join(out, "moe.json"), "md": os.path.join(out, "moe.md")}
    if "json" in targets:
        write_json(targets["json"], meta, rows)
    if "md" in targets:
        write_markdown(targets["md"], "NVFP4 MoE forward", summary_lines(meta),
                       markdown_table(rows, columns(args.paths)), report_notes(args, rows))  # fmt: skip
    return list(targets.values())


def stdout_report(args: argparse.Namespace, meta: dict, rows: list[dict]) -> str:
    """The summary, one line per model and the table (statuses clipped), for the terminal."""
    short = [dict(r, status=_clip(r.get("status"), 60)) for r in rows]
    table = markdown_table(short, [c for c in columns(args.paths) if c[0] != "touched_experts"])
    return "\n".join(["", *summary_lines(meta), *model_summaries(rows), table])


def run(args: argparse.Namespace, log: Callable[[str], None] = log) -> list[dict]:
    """Measure ``args`` (finish_args'), print the report, write ``args.out`` when given; returns the rows."""
    meta, rows = measure(args, log)
    log(stdout_report(args, meta, rows))
    if args.out:
        log(f"wrote {', '.join(write_reports(args.out, args, meta, rows))}; total {meta['wall_s']:.0f} s")
    return rows
