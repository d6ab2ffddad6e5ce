"""Serving benchmark through the OpenAI HTTP server: ours vs vLLM modelopt_fp4 (Marlin) vs Humming vs BF16.

    python benchmarks/serve_bench.py --model qwen3-30b-a3b --paths ours          # one path per call: ~5 min on an H200
    python benchmarks/serve_bench.py --model mixtral-8x7b --paths vllm_modelopt_fp4 bf16
    python benchmarks/serve_bench.py --workload prefill-heavy --paths ours ours_w4a8 humming   # 2048 in, 128 out

Per path: ``vllm serve`` (tests/helpers_engine.py ``VllmServer``: loopback, a free port, its log under ``--out``)
on the checkpoints of e2e_throughput.py (the NVFP4 checkpoint written directly; BF16 from a config-only directory
with ``--load-format dummy``), then vLLM 0.26's own client, ``vllm bench serve``, once per request rate in
``--rates`` (``inf`` and two fixed rates by default): random dataset of ``--num-prompts`` prompts of
``--input-len`` tokens, ``--output-len`` output tokens with ``--ignore-eos``, TTFT / TPOT / ITL median and p99.
``--workload`` names the lengths: ``default`` (512 in, 256 out) or ``prefill-heavy`` (2048 in, 128 out: chunked
prefill runs the MoE at thousands of tokens a step, where prefill throughput decides); ``--input-len`` and
``--output-len`` override it.
The random dataset needs a tokenizer: a word-level one of the model's vocabulary is written beside each
checkpoint (tests/helpers_checkpoints.py ``write_word_tokenizer``), so nothing is downloaded.

Paths: ``ours`` = ``--quantization nvfp4_grouped``; ``vllm_modelopt_fp4`` = vLLM's NVFP4 MoE (Marlin on Hopper);
``humming`` = the same with ``--moe-backend humming`` (compiles its kernels with nvcc on first use: minutes);
``bf16`` = random BF16 weights; ``ours_w4a8`` = ours with ``MOE_NVFP4_FP8_ACTIVATIONS=1`` (the opt-in W4A8
mode: FP8 activations at prefill, design 008).  Every server gets the settings for hosts without NVLink multicast
(docs/vllm-plugin.md) in case ``--tensor-parallel-size`` > 1.

Writes ``<out>/serve_<model>_L<layers>.json`` and ``.md`` (``serve_<model>_L<layers>_<workload>`` for another
workload; output tok/s, TTFT and TPOT p50/p99 per path and rate, ours / each baseline) with device, versions, the
workload and the command; rows of earlier calls for other paths in the same file are kept when their workload
(lengths, prompts) was the same, so one path per call builds up one table (another workload there is refused).
Expected on one H200 at full depth: server start 2-4 min per path (load, torch.compile, CUDA graphs, our autotune
<= 50 s), each rate 0.5-1.5 min with the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from e2e_throughput import MODELS, checkpoints, environment  # noqa: E402
from helpers_checkpoints import write_word_tokenizer  # noqa: E402
from helpers_engine import VllmServer, free_port, vllm_command  # noqa: E402

PATHS = {  # name -> (checkpoint kind, server arguments)
    "ours": ("modelopt", ["--quantization", "nvfp4_grouped"]),
    "vllm_modelopt_fp4": ("modelopt", ["--quantization", "modelopt_fp4"]),
    "humming": ("modelopt", ["--quantization", "modelopt_fp4", "--moe-backend", "humming"]),
    "bf16": ("bf16", ["--load-format", "dummy"]),
    "ours_w4a8": ("modelopt", ["--quantization", "nvfp4_grouped"]),
}
PATH_ENV = {"ours_w4a8": {"MOE_NVFP4_FP8_ACTIVATIONS": "1"}}  # the opt-in W4A8 mode (design 008): its switch
NO_MULTICAST_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0"}
NO_MULTICAST_ARGS = ["--compilation-config", json.dumps({"pass_config": {"fuse_allreduce_rms": False}})]
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
START_S = 1200  # a full-depth start with Humming's first compile
BENCH_S = 900
# --workload: (input tokens, output tokens) per prompt
WORKLOADS = {"default": (512, 256), "prefill-heavy": (2048, 128)}
WORKLOAD_KEYS = ("workload", "input_len", "output_len", "num_prompts")  # what rows merged into one table share


def bench_arguments(port: int, name: str, tokenizer: Path, rate: float, args, result: Path) -> list[str]:
    """``vllm bench serve``'s arguments for one request rate (its result JSON at ``result``)."""
    return [
        "--backend",
        "vllm",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        name,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(rate),
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        "--disable-tqdm",
    ]


def bench_once(port: int, name: str, tokenizer: Path, rate: float, args, out_dir: Path) -> dict:
    """One ``vllm bench serve`` run; its result JSON."""
    result = out_dir / f"serve_{args.model}_{name}_{args.input_len}in{args.output_len}out_rate{rate}.json"
    cmd = vllm_command() + ["bench", "serve", *bench_arguments(port, name, tokenizer, rate, args, result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_S)
    if proc.returncode != 0 or not result.exists():
        return {"rate": rate, "error": (proc.stdout + proc.stderr)[-4000:]}
    raw = json.loads(result.read_text())
    row = {
        "rate": rate,
        **{m: raw.get(m) for m in METRICS},
        "completed": raw.get("completed"),
        "failed": raw.get("failed"),
    }
    if row["completed"] != args.num_prompts:  # timings over part of the requests are not this rate's numbers
        row["error"] = f"{row['completed']} of {args.num_prompts} requests completed ({row['failed']} failed)"
    return row


def run_path(name: str, ckpt: Path, args, out_dir: Path) -> dict:
    port = free_port()
    env = dict(os.environ, **NO_MULTICAST_ENV, **PATH_ENV.get(name, {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    serve_args = [
        str(ckpt),
        "--served-model-name",
        name,
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--max-model-len",
        str(args.input_len + args.output_len + 16),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        *PATHS[name][1],
        *NO_MULTICAST_ARGS,
    ]
    result = {"path": name, "server_args": serve_args}
    with VllmServer(serve_args, port=port, log_path=out_dir / f"serve_{args.model}_{name}.log", env=env) as server:
        try:
            result["start_s"] = server.start(START_S)
        except RuntimeError as e:
            print(f"{name}: server failed\n{str(e)[-2000:]}", file=sys.stderr)
            return {**result, "error": str(e)[-4000:]}
        result["rows"] = [bench_once(port, name, ckpt, rate, args, out_dir) for rate in args.rates]
        result["stop_s"] = server.stop(120)
    for row in result["rows"]:
        print(json.dumps({"path": name, **{k: v for k, v in row.items() if k != "error"}}), flush=True)
    return result


def markdown(report: dict) -> str:
    env, a = report["environment"], report["args"]
    lines = [
        "# Serving through vllm serve (vllm bench serve, random dataset)",
        "",
        f"Device {env['device']}; vLLM {env['vllm']}, torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
        f"moe_nvfp4 @ {env['git_commit']}; {env['date']}.",
        f"Model: {a['model']} shapes, {report['layers']} layers, random weights; workload {a.get('workload', 'default')}: "
        f"{a['num_prompts']} prompts of {a['input_len']} tokens, {a['output_len']} output tokens (ignore_eos), "
        f"TP {a['tensor_parallel_size']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| rate (req/s) | path | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ours tok/s / path | "
        "ours TPOT p50 / path |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(path, row["rate"]): row for path, r in report["results"].items() for row in r.get("rows", [])}
    for rate in a["rates"]:
        ours = by.get(("ours", rate))
        for path in report["results"]:
            row = by.get((path, rate))
            if row is None or "error" in row:
                lines.append(f"| {rate} | {path} | failed | | | | |")
                continue
            vs = lambda k: f"{ours[k] / row[k]:.2f}x" if ours and "error" not in ours and row.get(k) else "-"  # noqa: E731
            lines.append(
                f"| {rate} | {path} | {row['output_throughput']:.0f} | {row['median_ttft_ms']:.1f} / "
                f"{row['p99_ttft_ms']:.1f} | {row['median_tpot_ms']:.2f} / {row['p99_tpot_ms']:.2f} | "
                f"{vs('output_throughput')} | {vs('median_tpot_ms')} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's full depth)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["ours", "vllm_modelopt_fp4", "bf16"])
    ap.add_argument(
        "--rates", type=float, nargs="+", default=[math.inf, 4.0, 16.0], help="requests/s (inf: all at once)"
    )
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="default",
        help=", ".join(f"{name}: {i} tokens in, {o} out" for name, (i, o) in WORKLOADS.items()),
    )
    ap.add_argument("--input-len", type=int, default=None, help="tokens per prompt (default: the workload's)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens per prompt (default: the workload's)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/moe_nvfp4_e2e"), help="checkpoints (reused if present)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    input_len, output_len = WORKLOADS[args.workload]
    args.input_len = args.input_len or input_len
    args.output_len = args.output_len or output_len
    return args


def report_stem(args: argparse.Namespace, layers: int) -> Path:
    """Where the report goes: one file per model, depth and workload (the default workload's name left out)."""
    return args.out / (f"serve_{args.model}_L{layers}" + ("" if args.workload == "default" else f"_{args.workload}"))


def earlier_results(path: Path, args: argparse.Namespace) -> dict:
    """The results of earlier calls in the report at ``path`` (one path per call builds one table); ValueError
    when they ran another workload (lengths or prompts), whose rows are no comparison for this call's."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    theirs = {"workload": "default", **earlier["args"]}  # reports from before --workload ran the default
    differ = [k for k in WORKLOAD_KEYS if theirs.get(k) != getattr(args, k)]
    if differ:
        raise ValueError(
            f"{path} holds runs with another workload ({', '.join(f'{k}={theirs.get(k)}' for k in differ)}"
            f"); give another --out or the same workload"
        )
    return earlier["results"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    layers = args.layers or MODELS[args.model]["layers"]
    stem = report_stem(args, layers)
    try:
        results = dict(earlier_results(stem.with_suffix(".json"), args))
    except ValueError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 2
    ckpts = checkpoints(
        args.work_dir,
        args.layers,
        ["ours" if PATHS[p][0] == "modelopt" else "bf16" for p in args.paths],
        model=args.model,
    )
    for ckpt in ckpts.values():
        if not (ckpt / "tokenizer.json").exists():
            write_word_tokenizer(ckpt, MODELS[args.model]["vocab"])
    for p in args.paths:
        t0 = time.perf_counter()
        results[p] = {**run_path(p, ckpts[PATHS[p][0]], args, args.out), "wall_s": time.perf_counter() - t0}
    report = {
        "environment": environment(),
        "command": "python "
        + " ".join(shlex.quote(x) for x in [str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "layers": layers,
        "results": results,
    }
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all("error" not in r and all("error" not in row for row in r["rows"]) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
