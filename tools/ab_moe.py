"""Our forward under several variants in one process, timed interleaved (the machines drift by several
percent within the hour, so only same-run comparisons decide a kernel change).

    python tools/ab_moe.py --cases qwen3-30b-a3b:1,mixtral-8x7b:16 --variants shipped,partials_in_x_dtype
    mkdir /tmp/old && git archive HEAD~1 moe_nvfp4 | tar -x -C /tmp/old
    python tools/ab_moe.py --variants pkg=/tmp/old,shipped

    cp -r configs /tmp/before && python benchmarks/tune_moe.py --update ... && \
        python tools/ab_moe.py --variants configs=/tmp/before,shipped

A case is ``key:tokens``: a zoo key or a random layer's (``random-s0-03``, a row of the bench's random sweep); gated
layers run SiLU, Nemotron's ReLU^2 its own; an expert-parallel key such as ``dbrx-ep2`` runs bench_moe's inputs and expert map, this rank holding
the first E / EP experts.  A variant is ``shipped`` (the tuned config), ``pkg=DIR`` (the tuned config run by another version of the whole
package, DIR/moe_nvfp4, loaded unedited under a name of its own: a kernel, host or routing change; ``pkg=DIR|gemm2:...``
runs one of the GEMM variants below with it, so a kernel change is compared on a config the default does not pick), ``rules=DIR`` (the
config DIR/moe_nvfp4's selector picks, its default rules and tuned files, run by this package: a default-rule change), ``configs=DIR`` (the config a
configs directory such as an earlier copy of configs/ holds), or a boolean MoEKernelConfig field flipped on the
tuned config (``partials_in_x_dtype``, ...), or ``gemm1:field=value[/...]`` (gemm2, gemms: see gemm_variant), or ``w4a8`` / ``w4a8:field=value[/...]``
(the W4A8 mode on the folded e4m3 copy, sm90.w4a8: its default tiles or those Fp8Config fields; ``pkg=DIR|w4a8...``: that package's W4A8 forward),
or ``at=T`` (the config the selector picks for the same layer at T tokens: another token count's rule tried here)
or ``tile=N`` (the tuned config at token tile N, ``MoEKernelConfig.with_token_tile``).  Per case:
every variant's output is checked against the first's, then each is timed by CUDA-graph replay with rotating
weight copies (harness.time_graph, as bench_moe.py), ``--rounds`` times in turn; the table gives each
variant's median over rounds and its range.  ``--draws N`` times an expert-parallel case over N routings (bench_moe's
seeds 0..N-1): at a few tokens how many pairs land on this rank is a matter of the draw (none, at times), so a
decision there rests on the mean over draws, which the table then gives with the range of the draws' medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports


def load_package(directory: Path, scratch: Path, name: str):
    """Another version of the package (directory/moe_nvfp4) importable as ``name``, with its sm_90 host module
    (its relative imports resolve inside the copy): ``sm90.host``, or ``triton.moe_sm90`` in a tree from before the
    sm_90 backend had a folder of its own."""
    import shutil

    shutil.copytree(directory / "moe_nvfp4", scratch / name)
    sys.path.insert(0, str(scratch))
    folder = "sm90.host" if (scratch / name / "sm90" / "host.py").exists() else "triton.moe_sm90"
    return importlib.import_module(f"{name}.{folder}")


def package_config(host, cfg):
    """``cfg`` as the config class of the package ``host`` (a load_package module) belongs to: a field that version
    lacks (one added after it, or removed before it) is left out, as its from_dict may refuse it; a field only it has
    takes its default (config version 2's tile group, K split and stream-K fields: what the current kernels run)."""
    package = host.__name__.split(".")[0]
    configs = importlib.import_module(
        package + (".sm90.configs" if host.__name__.endswith(".sm90.host") else ".configs")
    )
    return config_as(configs, cfg)


def config_as(configs, cfg):
    """``cfg`` (any version's MoEKernelConfig) as the MoEKernelConfig of the ``configs`` module given, keeping only
    the fields that version has."""
    fields = {f.name for f in dataclasses.fields(configs.MoEKernelConfig)}
    gemm_fields = {f.name for f in dataclasses.fields(configs.GemmConfig)}
    d = {k: v for k, v in cfg.to_dict().items() if k in fields}
    for gemm in ("gemm1", "gemm2"):
        d[gemm] = {k: v for k, v in d[gemm].items() if k in gemm_fields}
    return configs.MoEKernelConfig.from_dict(d)


def their_selection(host, tokens: int, shape, device):
    """The config another package's selector (``host``: a load_package module) picks for ``tokens`` of ``shape`` on
    ``device``, as this package's config class (config_as: fields it lacks dropped, fields only it has defaulted)."""
    package = host.__name__.split(".")[0]
    shapes = importlib.import_module(f"{package}.shapes")
    tuned = importlib.import_module(f"{package}.sm90.tuned_configs")
    theirs = tuned.select_config(
        tokens, shapes.LayerShape(**dataclasses.asdict(shape)), shapes.DeviceTraits(**dataclasses.asdict(device))
    )
    from moe_nvfp4.sm90 import configs

    return config_as(configs, theirs)


def host_forward(host, x, weights, topk_weights, topk_ids, expert_map, config):
    """A forward of ``host.fused_moe_sm90`` (a load_package module, or the installed one) in its version's calling
    convention: the weights as one ``MoEWeights``, or, in a tree from before 2026-11-29, as the six tensors and the
    intermediate size."""
    import inspect

    if "w13_packed" in inspect.signature(host.fused_moe_sm90).parameters:
        tensors, inter = weights.tensors, weights.intermediate
        return lambda: host.fused_moe_sm90(x, *tensors, topk_weights, topk_ids, expert_map, inter, config)
    return lambda: host.fused_moe_sm90(x, weights, topk_weights, topk_ids, expert_map, config)


def tuned_config(directory: Path, select):
    """``select()`` (tuned_configs.select_config for a case) reading the tuned files under ``directory`` instead of the
    package's configs directory."""
    from moe_nvfp4.sm90 import tuned_configs

    shipped = tuned_configs.CONFIG_DIR
    tuned_configs.CONFIG_DIR = directory
    tuned_configs._tuned_entries.cache_clear()
    try:
        return select()
    finally:
        tuned_configs.CONFIG_DIR = shipped
        tuned_configs._tuned_entries.cache_clear()


def gemm_variant(cfg, variant: str):
    """``gemm1:field=value[/field=value...]`` (or gemm2, or gemms for both): the tuned config with those fields of
    one GEMM (or both) changed (integers, ``none`` for None), e.g. ``gemm1:num_stages=6/k_groups=2/max_registers=168``
    or ``gemms:narrow_tiles=2``; ``+`` joins changes applied in turn (``gemm1:...+gemm2:...``).  A variant that is
    not a valid config for a case is skipped there (run_case)."""
    for change in variant.split("+"):
        gemm, fields = change.split(":", 1)
        overrides = {}
        for item in fields.split("/"):
            name, value = item.split("=")
            overrides[name] = None if value == "none" else int(value)
        gemms = ("gemm1", "gemm2") if gemm == "gemms" else (gemm,)
        cfg = dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **overrides) for g in gemms})
    return cfg


def config_variant(cfg, variant: str, select_at):
    """A W4A16 variant of the tuned config ``cfg``: ``gemm1:...`` / ``gemm2:...`` / ``gemms:...`` (gemm_variant),
    ``at=T`` (``select_at(T)``: the config the selector picks for the same layer at T tokens, so another token
    count's rule is timed here), ``tile=N`` (``cfg`` at token tile N, MoEKernelConfig.with_token_tile), or a
    boolean MoEKernelConfig field flipped; ``+`` applies several in turn (``at=16384+gemms:narrow_tiles=1``)."""
    for change in variant.split("+"):
        if change.startswith(("gemm1:", "gemm2:", "gemms:")):
            cfg = gemm_variant(cfg, change)
        elif change.startswith("at="):
            cfg = select_at(int(change[len("at=") :]))
        elif change.startswith("tile="):
            cfg = cfg.with_token_tile(int(change[len("tile=") :]))
        else:
            cfg = dataclasses.replace(cfg, **{change: not getattr(cfg, change)})
    return cfg


def w4a8_config(variant: str):
    """``w4a8`` (None: the mode's tiles, Fp8Config()) or ``w4a8:field=value[/...]`` as an Fp8Config."""
    from moe_nvfp4.sm90.w4a8 import Fp8Config

    if variant == "w4a8":
        return None
    return Fp8Config(**{k: int(v) for k, v in (item.split("=") for item in variant.split(":", 1)[1].split("/"))})


def w4a8_form(variant: str) -> str | None:
    """``w4a8...`` or ``pkg=DIR|w4a8...``: the W4A8 form the variant runs (None: a W4A16 variant)."""
    form = variant.split("|", 1)[-1]
    return form if form.startswith("w4a8") else None


def config_record(variant: str, config) -> dict:
    """A row's config: the MoEKernelConfig's dict, or a W4A8 variant's Fp8Config fields ("default": the mode's rule)."""
    if w4a8_form(variant):
        return {"w4a8": dataclasses.asdict(config) if config else "default"}
    return config.to_dict()


def run_case(model: str, tokens: int, variants: list[str], modules: dict, rounds: int, draw: int = 0) -> list[dict]:
    import torch
    from harness import time_graph
    from tune_moe import make_layer, rotated_weights, seeded_inputs

    from moe_nvfp4 import prepare_moe_weights
    from moe_nvfp4.bench.harness import MoEShape
    from moe_nvfp4.bench.moe import make_inputs
    from moe_nvfp4.layouts import FragmentLayout
    from moe_nvfp4.shapes import device_traits
    from moe_nvfp4.sm90.tuned_configs import select_config
    from moe_nvfp4.sm90 import host as moe_sm90
    from moe_nvfp4.zoo import zoo_shape

    zs = zoo_shape(model)
    e, h, i, gated = zs.experts, zs.hidden, zs.intermediate, zs.activation.gated
    shape, device = zs.layer, device_traits(torch.device("cuda"))
    cfg = select_config(tokens, shape, device)
    tuned_in = {
        v: tuned_config(Path(v[len("configs=") :]), lambda: select_config(tokens, shape, device))
        for v in variants
        if v.startswith("configs=")
    }
    if zs.ep > 1:  # bench_moe's inputs and rank (the first E / EP experts local), so a row of its is repeated
        x, tw, ti, expert_map = make_inputs(MoEShape.from_zoo(zs), tokens, draw, "cuda")
    else:
        (x, tw, ti), expert_map = seeded_inputs(model, tokens), None
    # a non-gated layer (Nemotron's ReLU^2) packs with its activation; gated ones run SiLU, as make_layer draws them
    activation = {} if gated else {"activation": zs.activation}
    weights = prepare_moe_weights(*make_layer(e, h, i, "cuda", gated=gated), **activation)
    local_ids = ti if expert_map is None else expert_map[ti.long()]  # -1: another rank's expert
    copies = rotated_weights(weights, local_ids)

    folded: list = []  # the W4A8 variants' e4m3 copies of the rotated weights, folded once per case

    def configured(variant: str):
        if w4a8_form(variant):
            return w4a8_config(w4a8_form(variant))
        if variant in tuned_in:
            return tuned_in[variant]
        if variant.startswith("rules="):
            return their_selection(modules[variant], tokens, shape, device)
        if variant.startswith("pkg=") and "|" in variant:  # another package running a GEMM variant
            variant = variant.split("|", 1)[1]
        if variant == "shipped" or variant in modules:
            return cfg
        return config_variant(cfg, variant, lambda t: select_config(t, shape, device))

    def forwards(variant: str) -> list:
        c = configured(variant)
        if w4a8_form(variant):
            from moe_nvfp4.sm90.w4a8 import fold_to_fp8, fused_moe_w4a8

            folded[:] = folded or [fold_to_fp8(ws) for ws in copies]
            if variant.startswith("pkg="):  # that package's W4A8 forward on the same folded bytes
                other = importlib.import_module(modules[variant].__name__.split(".")[0] + ".sm90.w4a8")
                c = c and other.Fp8Config(**dataclasses.asdict(c))  # None: that package picks, as ours does
                fused_moe_w4a8 = other.fused_moe_w4a8
            return [lambda f=f, run=fused_moe_w4a8: run(x, f, tw, ti, expert_map, c) for f in folded]
        host = modules[variant] if variant.startswith("pkg=") else moe_sm90  # rules=: ours runs their config
        c = package_config(host, c) if variant.startswith("pkg=") else c
        return [host_forward(host, x, ws, tw, ti, expert_map, c) for ws in copies]

    padded = FragmentLayout().padded_k
    invalid = [
        v
        for v in variants
        if not w4a8_form(v)
        and ("|" in v or not (v == "shipped" or v.startswith(("pkg=", "configs="))))  # a config of this run's rules
        and not configured(v).is_valid(padded(h), padded(i), gated)
    ]
    for v in invalid:
        print(f"{model}:{tokens} {v}: not a valid config here, skipped", flush=True)
    variants = [v for v in variants if v not in invalid]

    times: dict[str, list[float]] = {v: [] for v in variants}
    errors: dict[str, float] = {}
    ref = None
    for v in variants:
        out = forwards(v)[0]().float()
        ref = out if ref is None else ref
        errors[v] = ((out - ref).norm() / ref.norm()).item()
    for _ in range(rounds):
        for v in variants:
            times[v].append(time_graph(forwards(v)).median_us)
    local_pairs = int((local_ids >= 0).sum())
    rows = []
    for v in variants:
        rows.append(
            dict(
                model=model,
                tokens=tokens,
                draw=draw,
                local_pairs=local_pairs,
                variant=v,
                median_us=statistics.median(times[v]),
                min_us=min(times[v]),
                max_us=max(times[v]),
                rel_diff=errors[v],
                copies=len(copies),
                config=config_record(v, configured(v)),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict], cases: list[str], variants: list[str]) -> list[str]:
    """One line per case: each variant's median µs and its range over rounds; over several draws, the mean of the
    draws' medians and their range, and the draws' local pairs."""
    lines = [f"{'case':<22}" + "".join(f"{v[-25:]:>26}" for v in variants)]
    for case in cases:
        model, tokens = case.split(":")
        mine = [r for r in rows if r["model"] == model and r["tokens"] == int(tokens)]
        draws = sorted({r.get("draw", 0) for r in mine})
        cells = []
        for v in variants:
            runs = [r for r in mine if r["variant"] == v]
            if not runs:
                cells.append("skipped")
            elif len(draws) == 1:
                cells.append(f"{runs[0]['median_us']:>9.1f} ({runs[0]['min_us']:.1f}-{runs[0]['max_us']:.1f})")
            else:
                medians = [r["median_us"] for r in runs]
                cells.append(f"{statistics.mean(medians):>9.1f} ({min(medians):.1f}-{max(medians):.1f})")
        pairs = {r.get("draw", 0): r.get("local_pairs") for r in mine}
        note = f"  local pairs by draw {[pairs[d] for d in draws]}" if len(draws) > 1 else ""
        lines.append(f"{case:<22}" + "".join(c.rjust(26) for c in cells) + note)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        default="mixtral-8x7b:1,mixtral-8x7b:16,mixtral-8x7b:64,qwen3-30b-a3b:1,qwen3-30b-a3b:16,qwen3-30b-a3b:64",
        help="model:tokens, comma separated",
    )
    p.add_argument(
        "--variants",
        default="shipped",
        help="shipped, pkg=DIR, rules=DIR, configs=DIR, gemm1:/gemm2:/gemms:..., at=T, tile=N, w4a8[:...] or a MoEKernelConfig field, comma separated",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--draws", type=int, default=1, help="routings per expert-parallel case (bench_moe's seeds 0..N-1)")
    p.add_argument("--out", type=Path, default=None, help="JSON lines of every row")
    args = p.parse_args()
    variants = args.variants.split(",")
    import torch

    from moe_nvfp4.zoo import zoo_shape

    with tempfile.TemporaryDirectory() as tmp:
        modules = {
            v: load_package(Path(v.split("=", 1)[1].split("|")[0]), Path(tmp), f"moe_nvfp4_{i}")
            for i, v in enumerate(variants)
            if v.startswith(("pkg=", "rules="))
        }
        rows, failed = [], []
        out = args.out.open("w") if args.out else None
        for case in args.cases.split(","):
            model, tokens = case.split(":")
            for draw in range(args.draws if zoo_shape(model).ep > 1 else 1):
                # a case that fails (out of memory, a kernel error) is reported and the batch goes on; each case's
                # rows are written as it ends, so a run cut short keeps what it timed
                try:
                    done = run_case(model, int(tokens), variants, modules, args.rounds, draw)
                except (RuntimeError, ValueError) as error:  # torch.OutOfMemoryError is a RuntimeError
                    failed.append(
                        f"{case} (draw {draw}): {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
                    )
                    print(f"ab_moe: {failed[-1]}", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                rows += done
                if out:
                    out.write("".join(json.dumps(r) + "\n" for r in done))
                    out.flush()
        if out:
            out.close()
    print("\n" + "\n".join(table(rows, args.cases.split(","), variants)))
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
