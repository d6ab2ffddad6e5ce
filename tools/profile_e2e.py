"""Where a vLLM generate step spends its time: per-kernel GPU time and host-side op counts, per path.

    python tools/profile_e2e.py --layers 4 --batches 1 64 --paths ours vllm_modelopt_fp4

Same checkpoints as e2e_throughput.py.  Each path runs in a fresh subprocess, the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so the torch profiler sees the model runner) or, with ``--multiprocess``,
as vLLM runs by default, the engine process tracing itself (vLLM's torch profiler; host op times are then
inclusive, not self).  Per batch size: one warm-up generate, then one profiled generate of that many prompts
x ``--output-len`` tokens.  Printed per path: wall time, GPU time per kernel (top 60), the host ops that
took longest, and how often a few host-side ops ran (an MoE op counted on the host during decode ran
outside the CUDA graph).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

from e2e_throughput import PATHS, VOCAB, checkpoints, engine_kwargs, run_runner  # noqa: E402

HOST_OPS = ("moe_nvfp4::fused_moe", "vllm::moe_forward", "cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel")

RUNNER = r"""
import glob, gzip, json, os, sys, time
from collections import Counter
args = json.loads(sys.argv[1])
if not args["multiprocess"]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import LLM, SamplingParams
extra = {}
if args["multiprocess"]:  # the engine process profiles itself and writes a trace
    extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": args["trace_dir"],
                                "torch_profiler_with_stack": False}
llm = LLM(**args["engine"], **extra)
g = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=0.0, max_tokens=args["output_len"], ignore_eos=True, detokenize=False)
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def summarize(events):  # events: (kind, name, count, us); kind 'gpu' or 'cpu' (cpu: self time where known)
    kernels, host, cpu = Counter(), Counter(), Counter()
    calls = Counter()
    for kind, name, count, us in events:
        if kind == "gpu":
            kernels[name[:90]] += us
            calls[name[:90]] += count
        else:
            cpu[name[:90]] += us
            if any(op in name for op in args["host_ops"]):
                host[name] += count
    top = [(k, (calls[k], us)) for k, us in kernels.most_common(60)]
    return {"gpu_kernel_us": sum(kernels.values()), "top_kernels": top, "host_op_counts": dict(host),
            "top_host_us": cpu.most_common(15)}


for batch in args["batches"]:
    prompts = [{"prompt_token_ids": torch.randint(0, args["vocab"], (args["input_len"],), generator=g).tolist()}
               for _ in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)
    if args["multiprocess"]:
        llm.start_profile()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        llm.stop_profile()
        traces = []
        for _ in range(120):  # the engine writes its trace after stop_profile returns
            traces = glob.glob(os.path.join(args["trace_dir"], "**", "*.json*"), recursive=True)
            if traces:
                time.sleep(5)
                break
            time.sleep(1)
        events = []
        for trace in glob.glob(os.path.join(args["trace_dir"], "**", "*.json*"), recursive=True):
            data = json.load(gzip.open(trace) if trace.endswith(".gz") else open(trace))
            events += [("gpu" if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset") else "cpu", e["name"], 1, e["dur"])
                       for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e and e.get("cat") in
                       ("kernel", "gpu_memcpy", "gpu_memset", "cpu_op", "cuda_runtime", "cuda_driver")]
            os.remove(trace)
    else:
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = [("gpu", e.key, e.count, e.device_time_total) if e.device_type == torch.autograd.DeviceType.CUDA
                  else ("cpu", e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    print("RESULT " + json.dumps({"batch": batch, "wall_s": wall, **summarize(events)}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["ours", "vllm_modelopt_fp4"])
    ap.add_argument("--multiprocess", action="store_true", help="profile the default multiprocess engine")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/moe_nvfp4_e2e"))
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    ckpts = checkpoints(args.work_dir, args.layers, args.paths)
    results = {}
    for path in args.paths:
        kind, quantization = PATHS[path]
        spec = {
            "engine": engine_kwargs(ckpts[kind], quantization, args.batches, args.input_len, args.output_len, 0.85),
            "batches": args.batches,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "vocab": VOCAB,
            "host_ops": HOST_OPS,
            "multiprocess": args.multiprocess,
            "trace_dir": str(args.work_dir / f"traces-{path}"),
        }
        proc = run_runner(RUNNER, spec)
        rows = [json.loads(x.removeprefix("RESULT ")) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if len(rows) != len(args.batches):
            print(f"{path}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)
        results[path] = rows
        for r in rows:
            steps = args.output_len
            print(
                f"\n== {path} B={r['batch']}: {r['wall_s'] * 1e3:.1f} ms wall, {r['gpu_kernel_us'] / 1e3:.1f} ms GPU "
                f"kernels ({steps} tokens each; {r['wall_s'] * 1e3 / steps:.2f} ms/step)"
            )
            print("host op counts:", json.dumps(r["host_op_counts"]))
            for name, (count, us) in r["top_kernels"]:
                print(f"{us / 1e3:9.2f} ms {count:7d}x  {name}")
            for name, us in r["top_host_us"]:
                print(f"{us / 1e3:9.2f} ms host  {name}")
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
    return 0 if all(len(r) == len(args.batches) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
