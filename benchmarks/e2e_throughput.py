"""Offline vLLM generation throughput: nvfp4_grouped vs vLLM's own NVFP4 (Marlin on Hopper) vs BF16.

    python benchmarks/e2e_throughput.py                       # 8 layers, batches 1 16 64 256, in 128 / out 128
    python benchmarks/e2e_throughput.py --layers 48           # the full Qwen3-30B-A3B depth (~60 GB BF16 on disk)
    python benchmarks/e2e_throughput.py --paths ours --batches 64

Model: Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048, expert intermediate 768, 32 query / 4 KV heads
of 128, vocab 151936) with random BF16 weights (std 0.02) and ``--layers`` decoder layers (default 8 rather
than 48, so the three checkpoints fit a 64 GB disk and the run takes minutes; per-token cost is linear in the
depth, so tokens/s at 48 layers is about 8/48 of the MoE+attention part).  The BF16 checkpoint is converted
with moe_nvfp4's converter to ModelOpt NVFP4 (experts only, weight-only, separate gate/up scales); the same
ModelOpt checkpoint runs as ``quantization="nvfp4_grouped"`` (ours) and ``quantization="modelopt_fp4"``
(vLLM 0.26; on Hopper, with no FP4 tensor cores, its MoE backend selection lands on Marlin).

Per path, one LLM in a fresh subprocess (default CUDA-graph mode); per batch size B: B prompts of
``--input-len`` random token ids, ``max_tokens=--output-len``, ``ignore_eos``, greedy; one warm-up
generate, then the median of ``--repeats`` timed generates; output tokens/s = B * output_len / seconds.
Writes ``<out>/e2e_throughput.json`` and ``.md`` with device, versions and the command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151936  # Qwen3's vocabulary; prompts are random ids below it
PATHS = {  # name -> (checkpoint kind, quantization argument)
    "ours": ("modelopt", "nvfp4_grouped"),
    "vllm_modelopt_fp4": ("modelopt", "modelopt_fp4"),
    "bf16": ("bf16", None),
}

RUNNER = r"""
import json, statistics, sys, time
args = json.loads(sys.argv[1])
from importlib.metadata import entry_points
if args["quantization"] == "nvfp4_grouped" and "nvfp4_grouped" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
    import os; os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    from moe_nvfp4_vllm.plugin import register; register()
import torch
from vllm import LLM, SamplingParams
llm = LLM(**args["engine"])
g = torch.Generator().manual_seed(0)
rows = []
for b in args["batches"]:
    prompts = [{"prompt_token_ids": torch.randint(0, args["vocab"], (args["input_len"],), generator=g).tolist()} for _ in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=args["output_len"], ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    secs = []
    for _ in range(args["repeats"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == args["output_len"] for o in outs)
    s = statistics.median(secs)
    rows.append({"batch": b, "seconds": s, "seconds_all": secs, "output_tokens_per_s": b * args["output_len"] / s})
    print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(args["out"], "w"))
"""


def qwen3_config(layers: int) -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=VOCAB,
        max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    d["torch_dtype"] = "bfloat16"
    return d


def write_random_checkpoint(out: Path, layers: int) -> Path:
    """Random BF16 Qwen3-MoE checkpoint with per-expert tensor names, one shard per layer (bounded memory)."""
    import torch
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config(layers)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(dev).manual_seed(0)
    h, i, v = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    e = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 renamed it for some families
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()

    weight_map = {}
    shards = [{"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        t = {
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": rnd(q * hd, h), f"{p}.self_attn.k_proj.weight": rnd(kv * hd, h),
            f"{p}.self_attn.v_proj.weight": rnd(kv * hd, h), f"{p}.self_attn.o_proj.weight": rnd(h, q * hd),
            f"{p}.self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{p}.self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{p}.mlp.gate.weight": rnd(e, h),
        }
        for x in range(e):
            t[f"{p}.mlp.experts.{x}.gate_proj.weight"] = rnd(i, h)
            t[f"{p}.mlp.experts.{x}.up_proj.weight"] = rnd(i, h)
            t[f"{p}.mlp.experts.{x}.down_proj.weight"] = rnd(h, i)
        shards.append(t)
    total = 0
    for n, t in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
        total += sum(x.numel() * x.element_size() for x in t.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def convert(src: Path, dst: Path) -> Path:
    if (dst / "config.json").exists():
        return dst
    import torch

    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    convert_checkpoint(src, dst, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True), device=device),
                       progress=False)
    return dst


def engine_kwargs(model: Path, quantization: str | None, batches: list[int], input_len: int, output_len: int,
                  mem: float) -> dict:
    """``LLM(...)`` arguments shared by every path here and by profile_e2e.py (the same engine)."""
    return dict(model=str(model), quantization=quantization, skip_tokenizer_init=True, dtype="bfloat16",
                max_model_len=input_len + output_len + 16, max_num_seqs=max(batches), gpu_memory_utilization=mem,
                seed=0)


def checkpoints(work_dir: Path, layers: int, paths: list[str]) -> dict[str, Path]:
    """Checkpoint kind -> directory: the random BF16 model, and its ModelOpt conversion when a path needs it."""
    bf16 = write_random_checkpoint(work_dir / f"qwen3-30b-a3b-shape-L{layers}-bf16", layers)
    ckpts = {"bf16": bf16}
    if any(PATHS[p][0] == "modelopt" for p in paths):
        ckpts["modelopt"] = convert(bf16, work_dir / f"qwen3-30b-a3b-shape-L{layers}-modelopt")
    return ckpts


def run_runner(runner: str, spec: dict) -> subprocess.CompletedProcess:
    """One path's engine in a fresh Python (vLLM holds the GPU until its process exits), this repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", runner, json.dumps(spec)], env=env, capture_output=True, text=True)


def run_path(name: str, model: Path, quantization: str | None, args, out_dir: Path) -> dict:
    out = out_dir / f"e2e_{name}.rows.json"
    spec = {"engine": engine_kwargs(model, quantization, args.batches, args.input_len, args.output_len,
                                    args.gpu_memory_utilization),
            "quantization": quantization, "batches": args.batches, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "vocab": VOCAB, "out": str(out)}
    t0 = time.perf_counter()
    proc = run_runner(RUNNER, spec)
    result = {"path": name, "quantization": quantization, "checkpoint": str(model), "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        result["error"] = proc.stderr[-4000:]
        print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
    else:
        result["rows"] = json.loads(out.read_text())
    return result


def environment() -> dict:
    import torch

    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "vllm": version("vllm"), "triton": version("triton"),
        "moe_nvfp4": version("moe_nvfp4"), "git_commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(report: dict) -> str:
    env, a = report["environment"], report["args"]
    lines = [
        "# vLLM offline generation throughput (output tokens/s)",
        "",
        f"Device {env['device']}; vLLM {env['vllm']}, torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
        f"moe_nvfp4 {env['moe_nvfp4']} @ {env['git_commit']}; {env['date']}.",
        f"Model: Qwen3-30B-A3B shapes, {a['layers']} layers, random weights; input {a['input_len']}, "
        f"output {a['output_len']} tokens, ignore_eos, greedy, median of {a['repeats']}.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    paths = [r for r in report["results"]]
    lines.append("| batch | " + " | ".join(r["path"] for r in paths) + " | ours / vllm_modelopt_fp4 | ours / bf16 |")
    lines.append("|---" * (len(paths) + 3) + "|")
    by = {r["path"]: {row["batch"]: row["output_tokens_per_s"] for row in r.get("rows", [])} for r in paths}
    for b in a["batches"]:
        cells = [f"{by[r['path']].get(b, float('nan')):.0f}" if b in by[r["path"]] else "failed" for r in paths]
        ours = by.get("ours", {}).get(b)
        ratios = []
        for base in ("vllm_modelopt_fp4", "bf16"):
            other = by.get(base, {}).get(b)
            ratios.append(f"{ours / other:.2f}x" if ours and other else "-")
        lines.append(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    for r in paths:
        if "error" in r:
            lines += ["", f"`{r['path']}` failed: see `error` in the JSON."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/moe_nvfp4_e2e"), help="checkpoints (reused if present)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpts = checkpoints(args.work_dir, args.layers, args.paths)
    results = [run_path(p, ckpts[PATHS[p][0]], PATHS[p][1], args, args.out) for p in args.paths]
    report = {
        "environment": environment(),
        "command": "python " + " ".join(shlex.quote(x) for x in [str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    (args.out / "e2e_throughput.json").write_text(json.dumps(report, indent=2))
    (args.out / "e2e_throughput.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all("rows" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
