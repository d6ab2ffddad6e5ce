"""One layer shape's rows of ``moe-nvfp4 bench`` (``moe_nvfp4.bench.moe`` says what is measured): its weights and
inputs, the paths built on them, and per token count the floors, the config ours runs, the outputs checked against
each other and the float32 reference, the paths timed in turns, and the ratios.

``run_model`` is the entry (the demo calls it too); the helpers below it are its steps, in order.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

from .harness import (
    Ceilings,
    MoEShape,
    Timing,
    floors,
    format_value,
    pct_of_floor,
    ratio,
    rotation_copies,
    sync,
    time_eager,
    time_with_fallback,
)
from .paths import BASELINES, NVFP4_PATHS, REGISTRY, Path, build_path, short_error

__all__ = [
    "add_ratios",
    "config_source",
    "copies_for",
    "expert_bytes",
    "make_inputs",
    "make_weights",
    "rel_err",
    "repro_command",
    "run_model",
    "time_path",
]

WEIGHT_CHUNK_BYTES = 2 << 30  # bf16 experts drawn and quantized this many bytes at a time (Kimi-K2: 34 GB in all)


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


def add_ratios(row: dict) -> None:
    """% of floor for every path (and ours' % of the compute floor alone) and ours' speedup over each baseline, from
    the row's times (None where one is missing)."""
    ours = row.get("ours_us")
    row["pct_of_floor"] = pct_of_floor(row["floor_us"], ours)
    row["pct_of_compute_floor"] = pct_of_floor(row.get("compute_floor_us"), ours)
    for name in BASELINES:
        row[f"{name}_pct_of_floor"] = pct_of_floor(row["floor_us"], row.get(f"{name}_us"))
        row[f"speedup_vs_{name}"] = ratio(row.get(f"{name}_us"), ours)
    # the batched format's experts stage, ours against Marlin's batched kernel on the same layout
    row["speedup_batched_vs_marlin_batched"] = ratio(row.get("marlin_batched_us"), row.get("ours_batched_us"))


def config_source(layer, traits, tokens: int) -> str:
    """Where ours' config for ``tokens`` of ``layer`` on ``traits`` comes from: ``autotuned`` (an entry measured in
    this process), ``tuned`` (a tuned file's entry) or ``default`` (sm90.default_config: no entry, or past them)."""
    from ..sm90.tuned_configs import entries_for, measured_entries, serving_entry

    if serving_entry(entries_for(layer, traits), tokens) is None:
        return "default"
    return "autotuned" if measured_entries(layer, traits) else "tuned"


# --------------------------------------------------------------------------------------------------
# Weights, inputs, copies
# --------------------------------------------------------------------------------------------------
def make_weights(shape: MoEShape, seed: int, device: str):
    """Random bf16 experts (std 1/sqrt(K)), NVFP4-quantized a few experts at a time; returns (w13_q, w2_q,
    w13_deq, w2_deq), the last two None where the dequantized BF16 layer does not fit in half the free memory
    (the BF16 path and the float reference then drop out of that model's rows)."""
    import torch

    from ..formats import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    step = max(1, WEIGHT_CHUNK_BYTES // shape.expert_bf16_bytes())

    def draw(n: int, k: int) -> NVFP4Tensor:
        parts = []
        for first in range(0, e, step):
            w = torch.randn(min(step, e - first), n, k, device=device, dtype=torch.bfloat16, generator=gen) * (k**-0.5)
            parts.append(quantize_nvfp4(w))  # one global scale per expert and matrix: vLLM's Marlin path keeps one
            del w
        return NVFP4Tensor(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("packed", "block_scale", "global_scale"))
        )

    w13_q, w2_q = draw(shape.w13_rows, h), draw(h, i)
    empty_cache()
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 40
    if e * shape.expert_bf16_bytes() > free // 2:
        return w13_q, w2_q, None, None

    def dequantized(q: NVFP4Tensor) -> torch.Tensor:  # the same experts at a time: its float32 temporaries too
        return torch.cat(
            [
                dequantize_nvfp4(
                    NVFP4Tensor(q.packed[a : a + step], q.block_scale[a : a + step], q.global_scale[a : a + step]),
                    torch.bfloat16,
                )
                for a in range(0, e, step)
            ]
        )

    w13_deq, w2_deq = dequantized(w13_q), dequantized(w2_q)
    empty_cache()
    return w13_q, w2_q, w13_deq, w2_deq


def make_inputs(shape: MoEShape, tokens: int, seed: int, device: str):
    """x, softmax top-k routing over the routing's experts, and under expert parallelism the expert map of the
    rank that holds the first ``experts`` of them (None without)."""
    import torch

    from ..routing import topk_softmax

    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + tokens)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, shape.global_experts, device=device, dtype=torch.float32, generator=gen)
    topk_weights, topk_ids = topk_softmax(logits, shape.top_k, renormalize=shape.renormalize)
    expert_map = None
    if shape.global_experts != shape.experts:
        expert_map = torch.full((shape.global_experts,), -1, dtype=torch.int32, device=device)
        expert_map[: shape.experts] = torch.arange(shape.experts, dtype=torch.int32, device=device)
    return x, topk_weights.contiguous(), topk_ids.contiguous(), expert_map


def expert_bytes(shape: MoEShape, path: str) -> int:
    """One expert's weight bytes as ``path`` holds them: bf16 for the paths on the dequantized copy, else NVFP4 (times
    the path's weight_bytes_factor: W4A8 holds an e4m3 copy beside them)."""
    cls = REGISTRY[path]
    return int(
        (shape.expert_bf16_bytes() if cls.weights == "bf16" else shape.expert_nvfp4_bytes()) * cls.weight_bytes_factor
    )


def copies_for(shape: MoEShape, tokens: list[int], path: str, args, l2: int) -> int:
    """Copies of ``path``'s weights needed at the smallest T (the fewest touched experts), capped by max and by
    memory; one on the CPU (no L2 to keep cold there: the host clock times a smoke test)."""
    import torch

    if args.no_rotate or args.device == "cpu":
        return 1
    per_expert = expert_bytes(shape, path)
    touched = shape.max_touched(min(tokens))
    want = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=args.max_copies)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 8 << 30
    by_memory = max(1, int(0.15 * free // max(per_expert * shape.experts, 1)))
    return max(1, min(want, by_memory))


def repro_command(args, key: str, tokens: int) -> str:
    """The command that reruns one row: this bench's command, its shape (a --shape key is E,K,H,I) and T."""
    shape = f"--shape {key}" if key[0].isdigit() else f"--models {key}"
    return f"{args.repro_command} {shape} --tokens {tokens}"


def time_path(path: Path, fns: list[Callable[[], Any]], args) -> Timing:
    """CUDA graph replay of ``fns`` in turn (eager, marked, where capture fails); eager for a path that reads
    its routing on the host, which no graph can hold; the host clock around eager calls on the CPU."""
    if args.device == "cpu":
        return time_eager(fns, iters=args.replays, note="host clock")
    if not path.graphable:
        return time_eager(fns, iters=args.replays * 2, note="reads its routing on the host")
    return time_with_fallback(fns, target_graph_ms=args.target_graph_ms, replays=args.replays, max_calls=args.max_calls)


# --------------------------------------------------------------------------------------------------
# One shape
# --------------------------------------------------------------------------------------------------
def run_model(
    key: str,
    shape: MoEShape,
    tokens: list[int],
    args,
    ceilings: Ceilings,
    l2: int,
    deadline: float,
    log: Callable[[str], None] = log,
) -> list[dict]:
    """The rows of one shape, a row per token count (see moe's docstring); ``log`` gets the progress lines."""
    t0 = time.time()
    ep = f" of {shape.global_experts} (expert parallel)" if shape.global_experts != shape.experts else ""
    log(f"\n== {shape.name}: E={shape.experts}{ep} top-{shape.top_k} H={shape.hidden} I={shape.intermediate}")
    weights = make_weights(shape, args.seed, args.device)
    log(f"   weights quantized in {time.time() - t0:.1f} s")
    paths, errors = build_paths(shape, weights, tokens, args, l2, log)
    autotuned = autotune_shape(shape, paths.get("ours"), tokens, args, log)
    rows: list[dict] = []
    for t in tokens:
        row = row_header(key, shape, t, args)
        if autotuned is not None:
            row["autotune"] = autotuned
        if time.time() > deadline:
            rows.append(dict(row, status="skipped (time budget)"))
            log(f"   T={t:5d} skipped: time budget reached")
            continue
        rows.append(measure_row(row, shape, weights, paths, errors, args, ceilings, l2))
        log_row(rows[-1], args, log)
    del paths, weights
    empty_cache()
    log(f"   {shape.name} done in {time.time() - t0:.1f} s")
    return rows


def build_paths(shape: MoEShape, weights: tuple, tokens: list[int], args, l2: int, log: Callable[[str], None]):
    """Each path of args.paths built with its weight copies: ({name: Path or None}, {name: why it is None})."""
    paths: dict[str, Path | None] = {}
    errors: dict[str, str] = {}
    for name in args.paths:
        n = copies_for(shape, tokens, name, args, l2)
        t1 = time.time()
        try:
            paths[name] = build_path(name, shape, weights, n)
            copies = len(paths[name].weights)
            log(f"   {name:7s} ready: {copies} weight cop{'y' if copies == 1 else 'ies'} ({time.time() - t1:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - one path failing must not stop the others
            paths[name] = None
            errors[name] = f"setup: {short_error(exc)}"
            log(f"   {name:7s} SETUP FAILED: {short_error(exc)}")
            if args.verbose:
                traceback.print_exc()
            empty_cache()  # what a path that ran out of memory left behind
        sync()
    return paths, errors


def autotune_shape(shape: MoEShape, ours: Path | None, tokens: list[int], args, log: Callable[[str], None]):
    """With --autotune on a GPU: ours' configs for this shape measured first (registered for its rows); what it
    took and chose, or None."""
    if not args.autotune or ours is None or args.device != "cuda":
        return None
    import torch

    from ..sm90.autotune import autotune_fused_moe

    _, _, _, emap = make_inputs(shape, 1, args.seed, args.device)
    report = autotune_fused_moe(
        ours.weights[0], shape.top_k, torch.bfloat16, max(tokens), expert_map=emap, budget_s=args.autotune_budget_s
    )
    log(f"   autotune: {report.summary()}")
    return dict(seconds=round(report.seconds, 1), source=report.source, summary=report.summary())


def row_header(key: str, shape: MoEShape, tokens: int, args) -> dict[str, Any]:
    return {
        "model": shape.name,
        "tokens": tokens,
        "num_experts": shape.experts,
        "global_experts": shape.global_experts,
        "top_k": shape.top_k,
        "hidden": shape.hidden,
        "inter": shape.intermediate,
        "activation": shape.activation,
        "repro": repro_command(args, key, tokens),
    }


def measure_row(
    row: dict, shape: MoEShape, weights: tuple, paths: dict, errors: dict, args, ceilings: Ceilings, l2: int
) -> dict:
    """``row`` at its token count: floors, ours' config, the outputs checked, the paths timed, the ratios."""
    import torch

    inputs = make_inputs(shape, row["tokens"], args.seed, args.device)
    x, _, topk_ids, expert_map = inputs
    local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
    touched = int(torch.unique(local[local >= 0]).numel())
    nbytes, flops = shape.hbm_bytes(row["tokens"], touched), shape.flops(row["tokens"])
    row.update(
        touched_experts=touched, hbm_bytes=nbytes, weight_bytes=touched * shape.expert_nvfp4_bytes(), flops=flops
    )
    row.update(floors(nbytes, flops, ceilings))
    if x.is_cuda:  # the config ours runs at this T and where it came from, so a row can be traced to it
        from ..shapes import device_traits
        from ..sm90.tuned_configs import select_config

        layer, traits = shape.layer, device_traits(x.device)
        row["ours_config"] = select_config(row["tokens"], layer, traits).to_dict()
        row["config_source"] = config_source(layer, traits, row["tokens"])
    notes = check_outputs(row, shape, inputs, weights, paths, errors, args)
    time_paths(row, shape, inputs, paths, touched, notes, args, l2)
    add_ratios(row)
    row["status"] = "ok" if not notes else "; ".join(notes)
    row["notes"] = notes
    return row


def check_outputs(
    row: dict, shape: MoEShape, inputs: tuple, weights: tuple, paths: dict, errors: dict, args
) -> list[str]:
    """Every path once, eagerly, against the BF16 path and the float32 torch reference on the same weights: the
    rel_err_* fields of ``row``, its ``mismatched`` paths; returns the row's notes so far."""
    import torch

    from ..reference import moe_dense_torch

    x, topk_weights, topk_ids, expert_map = inputs
    _, _, w13_deq, w2_deq = weights
    notes: list[str] = []
    outs: dict[str, torch.Tensor] = {}
    ref = None
    if not args.no_ref and w13_deq is not None:
        try:
            ref = moe_dense_torch(
                x.float(),
                w13_deq,
                w2_deq,
                topk_weights,
                topk_ids,
                expert_map=expert_map,
                activation=shape.expert_activation,
                compute_dtype=torch.float32,
            )
        except Exception as exc:  # noqa: BLE001
            notes.append(f"ref: {short_error(exc)}")
    for name in args.paths:
        if paths.get(name) is None:
            notes.append(f"{name} {errors.get(name, 'unavailable')}")
            continue
        try:
            out = paths[name].fn(0, x, topk_weights, topk_ids, expert_map)()
            outs[name] = paths[name].tokens_out(out, x, topk_weights, topk_ids, expert_map).float()
            sync()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{name} run: {short_error(exc)}")
            if args.verbose:
                traceback.print_exc()
    mismatched = add_errors(row, outs, ref, args.tol)
    row["mismatched"] = list(mismatched)
    if mismatched:
        notes.append("MISMATCH " + ",".join(f"{name}={err:.1e}" for name, err in mismatched.items()))
    return notes


def add_errors(row: dict, outs: dict, ref, tol: float) -> dict[str, float]:
    """rel_err_<path> of the NVFP4 paths vs the BF16 path, else the reference, else (no BF16 weights) vs Marlin;
    rel_err_<path>_vs_ref; ours against each NVFP4 baseline.  Returns {path: its error} of those over ``tol``
    (NaN included; a path's own error_floor raises its bound: W4A8's e4m3 roundings)."""
    base, basis = next(
        (
            (out, name)
            for out, name in ((outs.get("bf16"), "bf16"), (ref, "ref"), (outs.get("marlin"), "marlin"))
            if out is not None
        ),
        (None, None),
    )
    row["err_basis"] = basis
    for name in NVFP4_PATHS:
        if name in outs and name != basis:
            row[f"rel_err_{name}"] = rel_err(outs[name], base) if base is not None else None
    for name, out in outs.items():
        row[f"rel_err_{name}_vs_ref"] = rel_err(out, ref) if ref is not None else None
    for name in NVFP4_PATHS:
        if name != "ours" and "ours" in outs and name in outs:
            row[f"rel_err_ours_vs_{name}"] = rel_err(outs["ours"], outs[name])
    over = {}
    for name in outs:
        err = row.get(f"rel_err_{name}") if name in NVFP4_PATHS else None
        err = row.get(f"rel_err_{name}_vs_ref") if err is None else err
        if err is not None and not err <= max(tol, REGISTRY[name].error_floor):  # also catches NaN
            over[name] = err
    return over


def time_paths(
    row: dict, shape: MoEShape, inputs: tuple, paths: dict, touched: int, notes: list[str], args, l2: int
) -> None:
    """Graph replay over rotating weight copies (eager, marked, where capture fails); the paths take turns for
    args.rounds rounds and each path's time is its median round: the SM clock moves with the GPU's power state (a
    sustained forward may sit at the power cap), and in turns every path sees the same mix.  Fills ``row``'s
    <path>_us and <path>_timing and adds to ``notes``."""
    fns_of: dict[str, list] = {}
    for name in args.paths:
        p = paths.get(name)
        if p is None or any(n.startswith(f"{name} run") for n in notes):
            row[f"{name}_us"] = None
            continue
        per_expert = expert_bytes(shape, name)
        n_rot = (
            1
            if args.no_rotate
            else rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=len(p.weights))
        )
        fns_of[name] = [p.fn(c, *inputs) for c in range(n_rot)]
        needed = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=10**6)
        if not args.no_rotate and n_rot < needed and args.device == "cuda":
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
        if middle.method != "graph" and paths[name].graphable and args.device == "cuda":
            notes.append(f"{name} eager ({middle.note})")


def log_row(row: dict, args, log: Callable[[str], None]) -> None:
    times = " ".join(f"{name}={format_value(row.get(f'{name}_us'))}" for name in args.paths)
    errs = " ".join(
        f"{name}={format_value(row.get(f'rel_err_{name}'), '.1e')}" for name in args.paths if name in NVFP4_PATHS
    )
    status = row["status"]
    log(
        f"   T={row['tokens']:5d} touched={row['touched_experts']:3d} {times} floor={row['floor_us']:.1f}us "
        f"({row['bound']}) ours%floor={format_value(row['pct_of_floor'], '.0f')} err {errs}"
        + (f"  [{status if len(status) <= 300 else status[:297] + '...'}]" if row["notes"] else "")
    )
