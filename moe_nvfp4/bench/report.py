"""What ``moe-nvfp4 bench`` reports (``moe_nvfp4.bench.moe`` measures): the table's columns, a line per model, the
prefill summary (issue 58's targets read off one table), the header (GPU or CPU), the JSON and Markdown files.

Everything here works on rows and meta alone (no torch), so the CPU tests check it on rows they make up.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
from typing import Any

from .harness import markdown_table, write_json, write_markdown
from .paths import BASELINES, NVFP4_PATHS, PATHS, REGISTRY

__all__ = [
    "COLUMNS",
    "PREFILL_TARGETS",
    "PREFILL_TOKENS",
    "columns",
    "configs_meta",
    "merge_reports",
    "model_summaries",
    "prefill_summary",
    "prefill_table",
    "read_report",
    "stdout_report",
    "summary_lines",
    "write_reports",
]

_LABEL = {name: cls.label for name, cls in REGISTRY.items()}
COLUMNS = [
    ("model", "model", ""),
    ("config_source", "config", ""),
    ("tokens", "T", "d"),
    ("touched_experts", "touched", "d"),
    *[(f"{p}_us", f"{_LABEL[p]} µs", ".1f") for p in PATHS],
    ("floor_us", "floor µs", ".1f"),
    ("bound", "bound", ""),
    ("pct_of_floor", "ours % floor", ".0f"),
    *[(f"{p}_pct_of_floor", f"{_LABEL[p]} % floor", ".0f") for p in NVFP4_PATHS if p != "ours"],
    *[(f"speedup_vs_{p}", f"× {_LABEL[p]}", ".2f") for p in BASELINES],
    *[(f"rel_err_{p}", f"err {_LABEL[p]}", ".1e") for p in NVFP4_PATHS],
    ("status", "status", ""),
]

# Prefill: rows from this many tokens on, and what issue 58 asks of them (ours' % of the bf16 compute floor, ours'
# speedup over the BF16 and Humming paths).
PREFILL_TOKENS = 1024
PREFILL_TARGETS = {"pct_of_compute_floor": 75.0, "speedup_vs_bf16": 1.0, "speedup_vs_humming": 1.3}
_PREFILL_STATS = list(dict.fromkeys([*PREFILL_TARGETS, *(f"speedup_vs_{p}" for p in BASELINES)]))  # targets first


def columns(paths: list[str]) -> list[tuple[str, str, str]]:
    """COLUMNS less the time, % floor, speedup and error columns of the paths not run."""
    own = {p: {f"{p}_us", f"{p}_pct_of_floor", f"speedup_vs_{p}", f"rel_err_{p}"} for p in PATHS}
    dropped = set().union(*(own[p] for p in PATHS if p not in paths))
    return [c for c in COLUMNS if c[0] not in dropped]


def _min_median(values: list[float]) -> dict[str, float] | None:
    return {"min": min(values), "median": statistics.median(values)} if values else None


def model_summaries(rows: list[dict]) -> list[str]:
    """One line per model: min / median speedup vs each baseline and % of floor over its timed rows."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        parts = []
        for col, label in [*((f"speedup_vs_{p}", f"x {_LABEL[p]}") for p in BASELINES), ("pct_of_floor", "% floor")]:
            values = sorted(r[col] for r in mine if r.get(col) is not None)
            if values:
                parts.append(f"{label} min {values[0]:.2f} median {statistics.median(values):.2f}")
        sources = sorted({r["config_source"] for r in mine if r.get("config_source")})
        out.append(f"{model} ({'/'.join(sources) or 'no config'}): " + ("; ".join(parts) or "no timed rows"))
    return out


def _prefill_values(rows: list[dict], column: str) -> list[float]:
    """``column`` of the rows whose output matched: ours' own columns need ours to match, a speedup its baseline
    too (a ratio against a wrong answer says nothing)."""
    baseline = column.removeprefix("speedup_vs_") if column.startswith("speedup_vs_") else None
    return [
        r[column]
        for r in rows
        if r.get(column) is not None
        and "ours" not in r.get("mismatched", ())
        and baseline not in r.get("mismatched", ())
    ]


def prefill_summary(rows: list[dict], min_tokens: int = PREFILL_TOKENS) -> dict[str, Any]:
    """Over the timed rows with T >= ``min_tokens``, per model and for all of them: how many, and min / median of
    ours' % of the compute floor and its speedup over each baseline; and how many rows meet each of
    PREFILL_TARGETS.  {} when no row is that large."""
    prefill = [r for r in rows if r.get("tokens", 0) >= min_tokens and r.get("ours_us") is not None]
    if not prefill:
        return {}
    stats = _PREFILL_STATS
    groups = {m: [r for r in prefill if r["model"] == m] for m in dict.fromkeys(r["model"] for r in prefill)}
    groups["all"] = prefill

    def summary(group: list[dict]) -> dict[str, Any]:
        return {"rows": len(group), **{c: _min_median(_prefill_values(group, c)) for c in stats}}

    targets = {}
    for column, target in PREFILL_TARGETS.items():
        values = _prefill_values(prefill, column)
        targets[column] = {"target": target, "met": sum(v >= target for v in values), "of": len(values)}
    return {"min_tokens": min_tokens, "by_model": {m: summary(g) for m, g in groups.items()}, "targets": targets}


def prefill_table(summary: dict[str, Any]) -> list[str]:
    """prefill_summary as Markdown: a row per model (and all), min / median per column, then the targets line."""
    if not summary:
        return []
    by_model = summary["by_model"]
    stats = [c for c in _PREFILL_STATS if any(s[c] for s in by_model.values())]
    header = {
        "pct_of_compute_floor": "ours % compute floor",
        **{f"speedup_vs_{p}": f"× {_LABEL[p]}" for p in BASELINES},
    }
    cell = lambda mm, spec: "-" if mm is None else f"{mm['min']:{spec}} / {mm['median']:{spec}}"  # noqa: E731
    lines = [
        f"Prefill (T >= {summary['min_tokens']}, rows whose outputs matched; min / median):",
        "",
        "| model | rows | " + " | ".join(header[c] for c in stats) + " |",
        "|---|---:|" + "---:|" * len(stats),
    ]
    for model, s in by_model.items():
        cells = [cell(s[c], ".0f" if c == "pct_of_compute_floor" else ".2f") for c in stats]
        lines.append(f"| {'**all**' if model == 'all' else model} | {s['rows']} | " + " | ".join(cells) + " |")
    met = [
        f"{header[c]} >= {t['target']:g}{'%' if c == 'pct_of_compute_floor' else 'x'}: {t['met']} of {t['of']}"
        for c, t in summary["targets"].items()
        if t["of"]
    ]
    return [*lines, "", "Rows meeting issue 58's targets: " + ("; ".join(met) or "none timed") + "."]


def configs_meta(rows: list[dict]) -> dict[str, Any]:
    """Where ours' configs came from over the rows: ``tuned_entries`` true iff a tuned file's or the autotuner's
    entry served at least one row, and the count of rows per source."""
    sources = [r["config_source"] for r in rows if r.get("config_source")]
    counts = {s: sources.count(s) for s in sorted(set(sources))}
    return {"tuned_entries": any(s != "default" for s in sources), "config_sources": counts}


def _configs_line(meta: dict) -> str:
    counts = meta.get("config_sources") or {}
    served = sum(n for s, n in counts.items() if s != "default")
    by_source = ", ".join(f"{s} {n}" for s, n in counts.items())
    head = (
        f"tuned entries served {served} of {sum(counts.values())} rows ({by_source})"
        if meta.get("tuned_entries")
        else "no tuned entries: every row ran the default config"
    )
    return (
        f"configs: {head} (tuned_entries {str(bool(meta.get('tuned_entries'))).lower()}); tuned file "
        f"{meta.get('tuned_file') or 'none'} (MOE_NVFP4_CONFIG_DIR={meta.get('config_dir')}); autotuning "
        f"{'ran' if meta.get('autotune') else 'off'}"
    )


def _random_line(meta: dict) -> list[str]:
    rnd = meta.get("random")
    if not rnd:
        return []
    b = rnd["bounds"]
    return [
        f"random layers: seed {', '.join(map(str, rnd['seeds']))} (default {rnd['default_seed']}), "
        f"{len(rnd['layers'])} drawn: E {b['min_experts']}-{b['max_experts']} (log-uniform), "
        f"top-k 1-{b['max_top_k']}, H and I multiples of {b['dim_step']} in {b['min_dim']}-{b['max_dim']}, "
        f"gated SiLU, at most {b['max_params'] / 1e9:.1f} G expert parameters (the zoo's largest layer)"
    ]


def summary_lines(meta: dict) -> list[str]:
    """The report's header: device and versions, ceilings, command, timing, configs; on the CPU what it says there
    (no GPU, no cuBLAS, no CUDA graphs: a smoke test of the bench)."""
    c = meta["ceilings"]
    versions = (
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, vllm {meta.get('vllm')}, humming-kernels "
        f"{meta.get('humming_kernels')}"
    )
    command = f"command: `{meta['command']}`; {meta['date']}; commit {meta.get('git_commit')}" + (
        " (dirty)" if meta.get("git_dirty") else ""
    )
    if meta.get("device_kind") == "cpu":
        ours = (
            "the torch reference (moe_nvfp4.reference), no kernel"
            if meta.get("ours_reference")
            else f"the {meta.get('ours_backend')} backend's kernels under the Triton interpreter"
        )
        return [
            f"device: CPU ({meta.get('cpu')}, {meta.get('cpu_threads')} torch threads): a smoke test of the bench, "
            f"not a kernel measurement; ours ran {ours}; {versions}",
            f"host ceilings: copy {c['copy_GBps']:.1f} GB/s (read+write, {c['copy'].get('bytes', 0) >> 20} MiB), "
            f"bf16 torch.mm {c['bf16_TFLOPs'] * 1e3:.1f} GFLOP/s ({c['matmul'].get('n')}^3)",
            command,
            f"timing: host clock around eager calls, median per call; {meta.get('rounds', 1)} round(s)",
            *_random_line(meta),
        ]
    merged = meta.get("merged_from") or []
    return [
        f"device: {meta.get('device')} (sm_{str(meta.get('capability', '')).replace('.', '')}), {versions}",
        f"copy bandwidth {c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s "
        f"({c['matmul'].get('n')}^3, cuBLAS)",
        command + (f"; one of {len(merged)} runs merged (each in meta.merged_from)" if merged else ""),
        f"timing: CUDA graph replay, median per call; {meta.get('rounds', 1)} rounds, the paths in turn, each row the "
        f"median round; L2: {meta['l2_policy']}",
        _configs_line(meta),
        *_random_line(meta),
    ]


def report_notes(repro_command: str, rows: list[dict], meta: dict) -> list[str]:
    """What the Markdown report says under its table: the columns, how to rerun a row, the prefill summary, a line
    per model."""
    prefill = prefill_table(meta.get("prefill") or {})
    return [
        "Columns: times are µs per MoE forward (see timing above); floor = max(HBM, compute) floor; "
        "% floor = floor / time (100 = at the floor); × = baseline time / our time; err = ||a - b|| / ||b|| vs the "
        "vLLM BF16 path on the same dequantized weights (vs the float32 torch reference without it).",
        "",
        f"Repro: `{repro_command} --models <shape key> --tokens <T>` (each row's `repro` in the JSON).",
        "",
        *([*prefill, ""] if prefill else []),
        "Per model (config: where ours' configs came from):",
        "",
        *[f"- {line}" for line in model_summaries(rows)],
    ]


def write_reports(out: str, args, meta: dict, rows: list[dict]) -> list[str]:
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
        notes = report_notes(args.repro_command, rows, meta)
        table = markdown_table(rows, columns(args.paths))
        write_markdown(targets["md"], "NVFP4 MoE forward", summary_lines(meta), table, notes)
    return list(targets.values())


def _clip(text: Any, n: int) -> Any:
    return text if not isinstance(text, str) or len(text) <= n else text[: n - 3] + "..."


def stdout_report(args, meta: dict, rows: list[dict]) -> str:
    """The summary, one line per model, the prefill summary and the table (statuses clipped), for the terminal."""
    short = [dict(r, status=_clip(r.get("status"), 60)) for r in rows]
    table = markdown_table(short, [c for c in columns(args.paths) if c[0] != "touched_experts"])
    prefill = prefill_table(meta.get("prefill") or {})
    return "\n".join(
        ["", *summary_lines(meta), *model_summaries(rows), *(["", *prefill] if prefill else []), "", table]
    )


# --------------------------------------------------------------------------------------------------
# Runs taken apart (one process per GPU of a host, or one command per lease) made one report
# --------------------------------------------------------------------------------------------------
def read_report(path: str) -> tuple[dict, list[dict]]:
    """(meta, rows) of a moe.json (or moe.json.gz), or of the moe.json in directory ``path``."""
    if os.path.isdir(path):
        found = [p for p in (os.path.join(path, "moe.json"), os.path.join(path, "moe.json.gz")) if os.path.exists(p)]
        path = found[0] if found else os.path.join(path, "moe.json")
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        data = json.load(f)
    return data["meta"], data["rows"]


def merge_reports(reports: list[tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """Several runs' (meta, rows) as one: the rows in order, the first run's meta with each run's command, date,
    commit and device under ``merged_from``, the paths and random layers of all, and the configs line and the
    prefill summary counted again over every row.  ValueError where the runs were taken on different devices."""
    if not reports:
        raise ValueError("no reports to merge")
    devices = {(m.get("device_kind"), m.get("device")) for m, _ in reports}
    if len(devices) > 1:
        raise ValueError(f"the runs were taken on different devices ({sorted(map(str, devices))}): one report a device")
    meta = dict(reports[0][0])
    rows = [r for _, run_rows in reports for r in run_rows]
    meta["merged_from"] = [
        {k: m.get(k) for k in ("command", "date", "git_commit", "git_dirty", "device", "wall_s")} for m, _ in reports
    ]
    paths = list(dict.fromkeys(p for m, _ in reports for p in m.get("args", {}).get("paths", [])))
    meta["args"] = {**meta.get("args", {}), "paths": paths}
    layers = [layer for m, _ in reports for layer in (m.get("random") or {}).get("layers", [])]
    if layers:
        seeds = sorted({s for m, _ in reports for s in (m.get("random") or {}).get("seeds", [])})
        meta["random"] = {**next(m["random"] for m, _ in reports if m.get("random")), "seeds": seeds, "layers": layers}
    meta.update(configs_meta(rows))
    meta["prefill"] = prefill_summary(rows)
    meta["wall_s"] = sum(m.get("wall_s") or 0.0 for m, _ in reports)
    return meta, rows
