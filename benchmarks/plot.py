"""Plot a bench_moe result: time per forward vs tokens, one panel per model, log-log, with the floor.

python benchmarks/plot.py benchmarks/results/moe.json [out.png]      (or a gzipped moe.json.gz)
"""

from __future__ import annotations

import gzip
import json
import sys

SERIES = (  # key, label, style
    ("ours_us", "ours (moe_nvfp4)", dict(marker="o", color="C0")),
    ("ours_w4a8_us", "ours W4A8 (opt-in FP8 activations)", dict(marker="v", color="C4")),
    ("marlin_us", "vLLM Marlin NVFP4", dict(marker="s", color="C1")),
    ("humming_us", "vLLM Humming NVFP4", dict(marker="D", color="C3")),
    ("bf16_us", "vLLM Triton BF16", dict(marker="^", color="C2")),
    ("floor_us", "floor max(HBM, compute)", dict(linestyle="--", color="k")),
    ("hbm_floor_us", "HBM floor", dict(linestyle=":", color="0.5")),
)
COLUMNS = 4  # panels per row (the zoo has dozens of shapes)


def plotted_models(rows: list[dict]) -> list[str]:
    """The models with a timing, in order: a row skipped for the time budget has tokens and no timing (no empty
    panel for it)."""
    return list(dict.fromkeys(r["model"] for r in rows if r.get("tokens") and any(r.get(k) for k, _, _ in SERIES)))


def plot_rows(rows: list[dict], path: str, *, title: str = "NVFP4 MoE forward") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = plotted_models(rows)
    if not models:
        raise ValueError("no rows with timings to plot")
    cols = min(COLUMNS, len(models))
    rows_of_panels = -(-len(models) // cols)
    small = len(models) > COLUMNS  # a zoo's dozens of panels: smaller panels, a small file
    size = (4.0, 3.0) if small else (6.0, 4.5)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(size[0] * cols, size[1] * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        mine = sorted((r for r in rows if r["model"] == model and r.get("tokens")), key=lambda r: r["tokens"])
        for key, label, style in SERIES:
            pts = [(r["tokens"], r[key]) for r in mine if r.get(key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per MoE forward")
        ax.set_title(model, fontsize=9 if small else None)
        ax.grid(True, which="both", alpha=0.3)
        if not small or ax is axes.flat[0]:  # one legend is enough for many panels
            ax.legend(fontsize=6 if small else 8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=70 if small else 120)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    with (gzip.open if argv[0].endswith(".gz") else open)(argv[0], "rt") as f:
        data = json.load(f)
    out = argv[1] if len(argv) > 1 else argv[0].removesuffix(".gz").rsplit(".", 1)[0] + ".png"
    device = data.get("meta", {}).get("device", "")
    print(plot_rows(data["rows"], out, title=f"NVFP4 MoE forward on {device}".strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
