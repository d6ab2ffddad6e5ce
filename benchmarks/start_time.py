"""vLLM engine starts, phase by phase: nvfp4_grouped (ours) against vLLM's own NVFP4 (Marlin on Hopper), every start
a first start (issue 53), or with ``--warm`` a second one.

    python benchmarks/start_time.py --model tiny --paths ours vllm_modelopt_fp4 --repeats 3
    CUDA_VISIBLE_DEVICES=0 python benchmarks/start_time.py --model qwen3-30b-a3b --paths ours &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/start_time.py --model qwen3-30b-a3b --paths vllm_modelopt_fp4 & wait
    python benchmarks/start_time.py --model mixtral-8x7b --paths ours --warm
    python benchmarks/start_time.py --model tiny --paths ours --variant serial --env MOE_NVFP4_WARMUP_THREADS=1

Models: ``qwen3-30b-a3b`` (48 layers) and ``mixtral-8x7b`` (32), random weights, checkpoints as
``e2e_throughput.py`` writes them (reused from ``--work-dir``); ``tiny``: a Qwen3-MoE of TINY's layer shape (the
MoE layer of issue 53's first-user model, 4 layers), written with transformers and converted by ``moe-nvfp4
convert``.  Each start is ``LLM(...)`` in a fresh Python (``e2e_throughput.run_runner``) with vllm serve's token
budget on a >= 70 GiB GPU (``max_num_batched_tokens`` 8192), then one short greedy generate (a kernel compiled
lazily shows up there).  Every cache a start writes lives in a fresh temporary directory: Triton's, torch
inductor's, vLLM's (torch.compile), the CUDA JIT's and our autotune cache, so the order of paths and runs does not
matter; ``--warm`` instead keeps them per path under ``--work-dir`` (a first, unrecorded start fills them).  The
checkpoint is read once before the starts, so every start finds it in the page cache.  FlashInfer's sampler is off
(``VLLM_USE_FLASHINFER_SAMPLER=0``: greedy never samples, and its JIT cache would favour whichever ran second).

Phases come from vLLM's own log lines (``PHASES``): weights loading, model loading (which holds our repack, the
plugin's config choice and warm-up), the plugin's autotune and warm-up compiles (summed over layer shapes),
torch.compile, the profiling run, CUDA-graph capture and the engine's whole init; ``init_repack_s`` is model
loading less weights, autotune and warm-up (module init and the experts' repack, either path).  One GPU per
process: with TP the per-rank lines would repeat.

Each call appends its starts to ``<out>/start_<model>_L<layers>.<label>.<mode>.json`` (``--reset`` drops that
file's earlier starts) and rebuilds ``start_<model>_L<layers>.{json,md}`` from every such file, so one path per GPU
in parallel (CUDA_VISIBLE_DEVICES), or a few repeats per call, build one table.  Parallel calls share the host's
CPUs, which compile for both: the table says how each start ran.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_throughput as e2e  # noqa: E402

REPO = e2e.REPO
MODES = ("first", "warm")
PATHS = ("ours", "vllm_modelopt_fp4", "bf16")
DEPTH = {"tiny": 4, **{k: v["layers"] for k, v in e2e.MODELS.items()}}
TINY = dict(experts=16, top_k=4, hidden=512, intermediate=256, vocab=4096)
MAX_BATCHED_TOKENS = 8192  # vllm serve's default on a GPU with >= 70 GiB (vLLM 0.26 arg_utils)
CACHE_ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "CUDA_CACHE_PATH", "MOE_NVFP4_CACHE_DIR")
# name -> vLLM's (or the plugin's) log line; the plugin's two are summed over layer shapes, the others logged once
PHASES = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
    "autotune_s": r"nvfp4_grouped: autotune .* in ([\d.]+) s;",
    "warmup_s": r"nvfp4_grouped: compiled MoE kernels .* in ([\d.]+) s",
    "torch_compile_s": r"torch\.compile (?:took|takes) ([\d.]+) s in total",
    "profiling_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "cuda_graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
SUMMED = ("autotune_s", "warmup_s")
COLUMNS = [
    ("engine_start_s", "engine start"),
    ("weights_s", "weights"),
    ("init_repack_s", "init + repack"),
    ("autotune_s", "autotune"),
    ("warmup_s", "MoE warm-up"),
    ("torch_compile_s", "torch.compile"),
    ("profiling_s", "profiling"),
    ("cuda_graphs_s", "CUDA graphs"),
    ("init_engine_s", "init engine"),
    ("first_generate_s", "first generate"),
]

RUNNER = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
os.environ.update(args["env"])  # before torch, Triton and vLLM read their cache directories
from importlib.metadata import entry_points
if args["quantization"] == "nvfp4_grouped" and "nvfp4_grouped" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    from moe_nvfp4_vllm.plugin import register; register()
from vllm import LLM, SamplingParams
t0 = time.perf_counter()
llm = LLM(**args["engine"])
start_s = time.perf_counter() - t0
t0 = time.perf_counter()
out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}],
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
generate_s = time.perf_counter() - t0
assert len(out[0].outputs[0].token_ids) == 8
json.dump({"engine_start_s": start_s, "first_generate_s": generate_s}, open(args["out"], "w"))
"""


def parse_phases(lines: list[str]) -> dict[str, float]:
    """Seconds per phase from a start's log lines (``PHASES``; a phase with no line is absent) and
    ``init_repack_s`` where model loading and weights loading are both there."""
    found: dict[str, float] = {}
    for line in lines:
        for name, pattern in PHASES.items():
            m = re.search(pattern, line)
            if m and (name in SUMMED or name not in found):
                found[name] = found.get(name, 0.0) + float(m.group(1)) if name in SUMMED else float(m.group(1))
    if "model_loading_s" in found and "weights_s" in found:
        found["init_repack_s"] = round(
            found["model_loading_s"] - found["weights_s"] - found.get("autotune_s", 0.0) - found.get("warmup_s", 0.0), 2
        )
    return found


def write_tiny_checkpoint(work_dir: Path, layers: int) -> dict[str, Path]:
    """A Qwen3-MoE of TINY's MoE layer at ``layers`` layers, random BF16 (transformers), and its NVFP4 conversion
    by our converter with its defaults; both reused if present."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moe_nvfp4.convert import ConvertOptions, convert_checkpoint

    bf16, fp4 = work_dir / f"tiny-L{layers}-bf16", work_dir / f"tiny-L{layers}-nvfp4"
    if not (bf16 / "config.json").exists():
        cfg = Qwen3MoeConfig(
            hidden_size=TINY["hidden"],
            moe_intermediate_size=TINY["intermediate"],
            intermediate_size=2 * TINY["intermediate"],
            num_experts=TINY["experts"],
            num_experts_per_tok=TINY["top_k"],
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=TINY["vocab"],
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(bf16.with_name(bf16.name + ".partial"))
        bf16.with_name(bf16.name + ".partial").rename(bf16)
    if not (fp4 / "config.json").exists():
        convert_checkpoint(bf16, fp4, ConvertOptions(), progress=False)  # the converter's defaults, as a user runs it
    return {"bf16": bf16, "modelopt": fp4}


def checkpoints(model: str, layers: int, paths: list[str], work_dir: Path) -> dict[str, Path]:
    """Checkpoint kind -> directory, written once: parallel calls wait on a lock instead of writing it twice."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(work_dir / f".{model}-L{layers}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if model == "tiny":
            return write_tiny_checkpoint(work_dir, layers)
        return e2e.checkpoints(work_dir, layers, paths, model=model)


def preread(directory: Path) -> float:
    """Read every weight file once (page cache), so no start pays the disk; returns the seconds it took."""
    began = time.perf_counter()
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb") as h:
            while h.read(64 << 20):
                pass
    return time.perf_counter() - began


def engine(ckpt: Path, quantization: str | None, mem: float) -> dict:
    kwargs = e2e.engine_kwargs(ckpt, quantization, [1024], 8, 8, mem)  # e2e's engine, vllm serve's budgets
    kwargs.pop("max_model_len")  # the config's 4096
    return dict(kwargs, max_num_batched_tokens=MAX_BATCHED_TOKENS)


def run_start(path: str, ckpt: Path, caches: Path, args: argparse.Namespace) -> dict:
    """One engine start of ``path`` with its caches under ``caches``: seconds, phases, the log lines they came from."""
    caches.mkdir(parents=True, exist_ok=True)
    env = {name: str(caches / name.lower()) for name in CACHE_ENV}
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", **dict(kv.split("=", 1) for kv in args.env))
    out = caches / "start.json"
    out.unlink(missing_ok=True)
    quantization = e2e.PATHS[path][1]
    spec = {
        "engine": engine(ckpt, quantization, args.gpu_memory_utilization),
        "quantization": quantization,
        "env": env,
        "out": str(out),
    }
    proc = e2e.run_runner(RUNNER, spec)
    lines = (proc.stdout or "").splitlines() + (proc.stderr or "").splitlines()
    kept = [line for line in lines if "nvfp4_grouped:" in line or any(m in line for m in e2e.START_LOG_MARKERS)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "log": kept[: e2e.LOG_LINES_KEPT], **parse_phases(kept)}
    if proc.returncode != 0 or not out.exists():
        result["error"] = (proc.stderr or "")[-4000:]
        print(f"{path}: start FAILED\n{(proc.stderr or '')[-2000:]}", file=sys.stderr)
    else:
        result.update(json.loads(out.read_text()))
    return result


def _label(args: argparse.Namespace, path: str) -> str:
    return f"{path}-{args.variant}" if args.variant else path


def _part(args: argparse.Namespace, path: str, layers: int) -> Path:
    mode = "warm" if args.warm else "first"
    return args.out / f"start_{args.model}_L{layers}.{_label(args, path)}.{mode}.json"


def _write(path: Path, text: str) -> None:
    """Atomically: calls on other GPUs read and write these files too."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def merge(out: Path, model: str, layers: int) -> dict:
    """Every part file of ``model`` at ``layers`` as one report."""
    parts = [json.loads(p.read_text()) for p in sorted(out.glob(f"start_{model}_L{layers}.*.*.json"))]
    order = {p: i for i, p in enumerate(PATHS)}
    parts.sort(key=lambda r: (MODES.index(r["mode"]), order.get(r["path"], 9), r["label"]))
    return {"model": model, "layers": layers, "results": parts}


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.1f}" if len(values) == 1 else f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def markdown(report: dict) -> str:
    """One row per path and mode: the median of its starts per phase (min-max), and ours over Marlin's engine start."""
    lines = [
        f"# vLLM engine start, {report['model']} at {report['layers']} layers",
        "",
        "Seconds, median (min-max) of the starts; phases from vLLM's log lines (benchmarks/start_time.py). "
        "`first`: every cache empty; `warm`: the path's caches from an earlier start.",
        "",
    ]
    lines.append("| path | mode | starts | " + " | ".join(title for _, title in COLUMNS) + " | x Marlin (start) |")
    lines.append("|---" * (len(COLUMNS) + 4) + "|")
    ok = lambda r: [s for s in r["starts"] if "error" not in s]  # noqa: E731
    marlin = {
        r["mode"]: statistics.median([s["engine_start_s"] for s in ok(r)])
        for r in report["results"]
        if r["label"] == "vllm_modelopt_fp4" and ok(r)
    }
    for r in report["results"]:
        starts = ok(r)
        failed = len(r["starts"]) - len(starts)
        cells = [_cell([s[key] for s in starts if key in s]) for key, _ in COLUMNS]
        mine = statistics.median([s["engine_start_s"] for s in starts]) if starts else None
        ratio = f"{mine / marlin[r['mode']]:.2f}x" if mine and r["mode"] in marlin else "-"
        count = f"{len(starts)}" + (f" ({failed} failed)" if failed else "")
        lines.append(f"| {r['label']} | {r['mode']} | {count} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "How each ran:"]
    for r in report["results"]:
        env = r["environment"]
        lines.append(
            f"- `{r['label']}` {r['mode']}: {env['device']}; vLLM {env['vllm']}, torch {env['torch']}, Triton "
            f"{env['triton']}, moe_nvfp4 @ {env['git_commit']}; `{r['command']}`"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(DEPTH), default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's full depth)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=["ours", "vllm_modelopt_fp4"])
    ap.add_argument("--repeats", type=int, default=3, help="starts per path in this call")
    ap.add_argument(
        "--warm", action="store_true", help="second starts: keep each path's caches (filled by one start first)"
    )
    ap.add_argument(
        "--variant", default="", help="a name for this configuration (e.g. serial), kept apart in the table"
    )
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for the starts (repeatable)")
    ap.add_argument("--reset", action="store_true", help="drop this path/variant/mode's starts of earlier calls")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument(
        "--work-dir", type=Path, default=Path("/tmp/moe_nvfp4_e2e"), help="checkpoints (reused), warm caches"
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be >= 1")
    if any("=" not in kv for kv in args.env):
        ap.error(f"--env takes KEY=VALUE, got {[kv for kv in args.env if '=' not in kv]}")
    layers = args.layers or DEPTH[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    ckpts = checkpoints(args.model, layers, args.paths, args.work_dir)
    for kind in {e2e.PATHS[p][0] for p in args.paths}:
        print(f"{ckpts[kind]}: read in {preread(ckpts[kind]):.1f} s (page cache)")
    command = "python " + " ".join(
        shlex.quote(x) for x in [str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])
    )
    env = e2e.environment()
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        env["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    failed = False
    for path in args.paths:
        part = _part(args, path, layers)
        with contextlib.ExitStack() as stack:
            if args.warm:
                caches = args.work_dir / "caches" / f"{args.model}-L{layers}" / _label(args, path)
                if not caches.exists():
                    print(f"{path}: a first start fills the warm caches (not recorded)")
                    run_start(path, ckpts[e2e.PATHS[path][0]], caches, args)
            starts = []
            for n in range(args.repeats):
                where = caches if args.warm else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="start-")))
                starts.append(run_start(path, ckpts[e2e.PATHS[path][0]], where, args))
                s = starts[-1]
                print(
                    f"{_label(args, path)} {'warm' if args.warm else 'first'} start {n + 1}: "
                    + ("FAILED" if "error" in s else f"{s['engine_start_s']:.1f} s")
                )
        failed |= any("error" in s for s in starts)
        # read and written under a lock: a call on another GPU may have added starts of this path meanwhile
        with open(args.out / ".parts.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            earlier = [] if args.reset or not part.exists() else json.loads(part.read_text())["starts"]
            _write(
                part,
                json.dumps(
                    {
                        "path": path,
                        "label": _label(args, path),
                        "mode": "warm" if args.warm else "first",
                        "env": args.env,
                        "environment": env,
                        "command": command,
                        "starts": earlier + starts,
                    },
                    indent=1,
                ),
            )
    report = merge(args.out, args.model, layers)
    stem = f"start_{args.model}_L{layers}"
    _write(args.out / f"{stem}.json", json.dumps(report, indent=1))
    _write(args.out / f"{stem}.md", markdown(report))
    print(markdown(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
