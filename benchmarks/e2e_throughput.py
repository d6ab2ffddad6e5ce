"""Offline vLLM generation throughput: nvfp4_grouped vs vLLM's own NVFP4 (Marlin on Hopper) vs BF16, at full depth;
and the GPU memory each NVFP4 path takes on top while it repacks the experts at load.

    python benchmarks/e2e_throughput.py --model qwen3-30b-a3b            # 48 layers, batches 1 16 64 256, in/out 128
    python benchmarks/e2e_throughput.py --model mixtral-8x7b --paths ours  # one path per call keeps a call short
    python benchmarks/e2e_throughput.py --model qwen3-30b-a3b --load-memory --paths ours vllm_modelopt_fp4
    python benchmarks/e2e_throughput.py --layers 4                       # a shallow model (minutes, small disk)

Models (``--model``): Qwen3-30B-A3B (48 layers, 128 experts, top-8, hidden 2048, expert intermediate 768, 32 query /
4 KV heads of 128, vocab 151936) and Mixtral-8x7B (32 layers, 8 experts, top-2, hidden 4096, intermediate 14336,
vocab 32000) with random weights; ``--layers`` cuts the depth.  The NVFP4 checkpoint is written directly in our
converter's ModelOpt layout (``write_nvfp4_checkpoint``: random codes, sane scales; 18 GB for Qwen3-30B-A3B, 27 GB
for Mixtral-8x7B), so no BF16 copy has to fit the disk; it runs as ``quantization="nvfp4_grouped"`` (ours) and
``quantization="modelopt_fp4"`` (vLLM 0.26; on Hopper its MoE backend selection lands on Marlin).  BF16 runs from a
config-only directory with ``load_format="dummy"`` (vLLM's random weights).

Per path, one LLM in a fresh subprocess (default CUDA-graph mode); per batch size B: B prompts of
``--input-len`` random token ids, ``max_tokens=--output-len``, ``ignore_eos``, greedy; one warm-up
generate, then the median of ``--repeats`` timed generates; output tokens/s = B * output_len / seconds.  Each
path also records its engine start (``LLM(...)`` until it returns) and the plugin's load log lines (autotune and
compile times).

``--load-memory``: per NVFP4 path, an engine in this process tree with vLLM's engine core in-process, whose
``process_weights_after_loading`` is timed for memory: per layer, ``torch.cuda.max_memory_allocated`` during its
quant method's call minus what was allocated before it, next to one expert's and one layer's NVFP4 bytes.  Our
first MoE layer also compiles (and, with ``MOE_NVFP4_AUTOTUNE=1``, autotunes: its activations count there), so the
report gives it apart.

Writes ``<out>/e2e_<model>_L<layers>.json`` and ``.md`` (``e2e_load_memory_...`` for ``--load-memory``) with
device, versions and the command; a path's rows replace its earlier ones there, other paths' stay.  Expected on one H200: writing the checkpoint 1-3 min (once, reused), each path
3-5 min (engine start 1.5-3 min, 4 batch sizes x 4 generates); ``--load-memory`` 2-3 min a path.
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
VOCAB = 151936  # Qwen3's vocabulary; tools/profile_e2e.py's prompts are random ids below it
WEIGHT_RMS = 0.02  # random weights resemble a trained checkpoint's range (HF initializer std)
MODELS = {  # what a full model adds to its MoE layer (whose shape is moe_nvfp4/zoo.py's); weights are random
    "qwen3-30b-a3b": {"layers": 48, "vocab": VOCAB, "kv_heads": 4, "architecture": "Qwen3MoeForCausalLM"},
    "mixtral-8x7b": {"layers": 32, "vocab": 32000, "kv_heads": 8, "architecture": "MixtralForCausalLM"},
}
LOG_LINES_KEPT = 40  # per log list: the plugin logs a few lines per distinct layer shape, vLLM a few per start
# vLLM's own log lines for the phases of an engine start (weights and repack, torch.compile, profiling, CUDA graphs,
# the whole init; vLLM 0.26 says "torch.compile took", earlier releases "takes"): with plugin_log they say where a
# first start's time goes, for every path.
START_LOG_MARKERS = (
    "Loading weights took",
    "Model loading took",
    "torch.compile took",
    "torch.compile takes",
    "Compiling a graph for",
    "Initial profiling/warmup run took",
    "Graph capturing finished",
    "init engine (profile, create kv cache, warmup model) took",
)
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
t_start = time.perf_counter()
llm = LLM(**args["engine"])
start_s = time.perf_counter() - t_start
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
json.dump({"engine_start_s": start_s, "rows": rows}, open(args["out"], "w"))
"""


def model_config(model: str, layers: int | None) -> dict:
    """config.json of ``model`` (a key of MODELS) at ``layers`` decoder layers (None: the model's full depth)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from moe_nvfp4.zoo import zoo_shape

    m, moe = MODELS[model], zoo_shape(model)
    layers = layers or m["layers"]
    common = dict(
        num_hidden_layers=layers,
        vocab_size=m["vocab"],
        num_key_value_heads=m["kv_heads"],
        head_dim=128,
        hidden_size=moe.hidden,
        num_experts_per_tok=moe.top_k,
        num_attention_heads=32,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    if model == "qwen3-30b-a3b":  # its dense intermediate_size (6144) is unused: every layer is MoE
        cfg = Qwen3MoeConfig(
            intermediate_size=6144,
            moe_intermediate_size=moe.intermediate,
            num_experts=moe.experts,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    else:
        cfg = MixtralConfig(intermediate_size=moe.intermediate, num_local_experts=moe.experts, **common)
    d = cfg.to_dict()
    d["architectures"] = [m["architecture"]]
    d["torch_dtype"] = "bfloat16"
    return d


def _expert_names(model: str) -> tuple[str, dict[str, str]]:
    """(MoE module under the layer, checkpoint projection name by role)."""
    if model == "mixtral-8x7b":
        return "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}
    return "mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def write_nvfp4_checkpoint(out: Path, model: str, layers: int | None) -> Path:
    """A ModelOpt NVFP4 checkpoint written directly, as our converter lays it out (experts only, separate gate/up
    global scales), one shard per layer so memory stays bounded: random FP4 codes over the whole e2m1 range, block
    scales near 1 and a global scale of WEIGHT_RMS / (RMS of the codes), so a weight's RMS is about 0.02 like a
    real checkpoint's; attention, router, embeddings and lm_head random BF16 of std 0.02.  No BF16 copy of the
    experts is ever made (Mixtral-8x7B's would be 93 GB).  Reused if present."""
    import torch
    from safetensors.torch import save_file

    from moe_nvfp4.convert.quant_config import QuantSettings, hf_quant_config, quantization_config
    from moe_nvfp4.formats import NVFP4

    if (out / "config.json").exists():
        return out
    cfg = model_config(model, layers)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(dev).manual_seed(0)
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    e = cfg.get("num_experts") or cfg["num_local_experts"]
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    moe, proj = _expert_names(model)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    global_scale = torch.tensor(WEIGHT_RMS / float(e2m1.pow(2).mean().sqrt()), dtype=torch.float32)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * WEIGHT_RMS).to(torch.bfloat16).cpu()

    def nvfp4(rows: int, cols: int, prefix: str) -> dict[str, torch.Tensor]:
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device=dev, dtype=torch.uint8)
        scale = (0.75 + 0.5 * torch.rand(rows, cols // NVFP4.block_size, generator=g, device=dev)).to(NVFP4.scale_dtype)
        return {
            f"{prefix}.weight": packed.cpu(),
            f"{prefix}.weight_scale": scale.cpu(),
            f"{prefix}.weight_scale_2": global_scale.clone(),
        }

    ignore = ["lm_head"]
    weight_map, total = {}, 0
    shards = n_layers + 1
    for n in range(shards):
        if n == n_layers:
            t = {
                "model.embed_tokens.weight": rnd(v, h),
                "lm_head.weight": rnd(v, h),
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        else:
            p = f"model.layers.{n}"
            t = {
                f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                f"{p}.self_attn.q_proj.weight": rnd(q * hd, h),
                f"{p}.self_attn.k_proj.weight": rnd(kv * hd, h),
                f"{p}.self_attn.v_proj.weight": rnd(kv * hd, h),
                f"{p}.self_attn.o_proj.weight": rnd(h, q * hd),
                f"{p}.{moe}.gate.weight": rnd(e, h),
            }
            if model == "qwen3-30b-a3b":
                t[f"{p}.self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
                t[f"{p}.self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
            ignore += [f"{p}.self_attn.{x}_proj" for x in "qkvo"] + [f"{p}.{moe}.gate"]
            for x in range(e):
                for role, (rows, cols) in {"gate": (i, h), "up": (i, h), "down": (h, i)}.items():
                    t.update(nvfp4(rows, cols, f"{p}.{moe}.experts.{x}.{proj[role]}"))
        name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        save_file(t, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
        total += sum(x.numel() * x.element_size() for x in t.values())
    settings = QuantSettings(separate_gate_up_scales=True)
    cfg["quantization_config"] = quantization_config(settings, sorted(ignore))
    (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(settings, sorted(ignore)), indent=2))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


def write_config_only(out: Path, model: str, layers: int | None) -> Path:
    """A directory with only config.json (no quantization config): vLLM runs it with load_format="dummy"."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model_config(model, layers), indent=2))
    return out


def engine_kwargs(
    model: Path, quantization: str | None, batches: list[int], input_len: int, output_len: int, mem: float
) -> dict:
    """``LLM(...)`` arguments shared by every path here and by tools/profile_e2e.py (the same engine).  A directory
    without weights runs with vLLM's random (dummy) weights."""
    kwargs = dict(
        model=str(model),
        quantization=quantization,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=input_len + output_len + 16,
        max_num_seqs=max(batches),
        gpu_memory_utilization=mem,
        seed=0,
    )
    if not any(Path(model).glob("*.safetensors")):
        kwargs["load_format"] = "dummy"
    return kwargs


def checkpoints(work_dir: Path, layers: int | None, paths: list[str], model: str = "qwen3-30b-a3b") -> dict[str, Path]:
    """Checkpoint kind -> directory: the NVFP4 checkpoint (written directly) when a path needs it, and a
    config-only BF16 directory (random weights at load)."""
    depth = layers or MODELS[model]["layers"]
    ckpts = {"bf16": write_config_only(work_dir / f"{model}-L{depth}-bf16-dummy", model, layers)}
    if any(PATHS[p][0] == "modelopt" for p in paths):
        ckpts["modelopt"] = write_nvfp4_checkpoint(work_dir / f"{model}-L{depth}-nvfp4", model, layers)
    return ckpts


LOAD_RUNNER = r"""
import contextlib, json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and its one worker here: the patch below reaches them
args = json.loads(sys.argv[1])
from importlib.metadata import entry_points
if args["quantization"] == "nvfp4_grouped" and "nvfp4_grouped" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
    from moe_nvfp4_vllm.plugin import register; register()
import torch
import vllm.model_executor.model_loader.utils as loader_utils
inner = loader_utils.device_loading_context
rows = []
@contextlib.contextmanager
def measured(module, target_device):  # wraps each layer's process_weights_after_loading (vLLM 0.26 loader)
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    with inner(module, target_device):
        yield
    torch.cuda.synchronize()
    rows.append({"module": type(module).__name__, "before": before, "peak_extra": torch.cuda.max_memory_allocated() - before,
                 "kept_extra": torch.cuda.memory_allocated() - before})
loader_utils.device_loading_context = measured
from vllm import LLM
LLM(**args["engine"])
json.dump(rows, open(args["out"], "w"))
"""


def run_runner(runner: str, spec: dict) -> subprocess.CompletedProcess:
    """One path's engine in a fresh Python (vLLM holds the GPU until its process exits), this repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", runner, json.dumps(spec)], env=env, capture_output=True, text=True)


def run_path(name: str, model: Path, quantization: str | None, args, out_dir: Path) -> dict:
    out = out_dir / f"e2e_{args.model}_{name}.rows.json"
    spec = {
        "engine": engine_kwargs(
            model, quantization, args.batches, args.input_len, args.output_len, args.gpu_memory_utilization
        ),
        "quantization": quantization,
        "batches": args.batches,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "vocab": MODELS[args.model]["vocab"],
        "out": str(out),
    }
    t0 = time.perf_counter()
    proc = run_runner(RUNNER, spec)
    result = {"path": name, "quantization": quantization, "checkpoint": str(model), "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        result["error"] = proc.stderr[-4000:]
        print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
    else:
        ran = json.loads(out.read_text())
        result.update(engine_start_s=ran["engine_start_s"], rows=ran["rows"])
    # What the plugin chose and how long its autotune and compiles took at load (vLLM logs to stdout).
    lines = (proc.stdout or "").splitlines() + (proc.stderr or "").splitlines()
    result["plugin_log"] = [line for line in lines if "nvfp4_grouped:" in line][:LOG_LINES_KEPT]
    result["start_log"] = [line for line in lines if any(m in line for m in START_LOG_MARKERS)][:LOG_LINES_KEPT]
    return result


def expert_bytes(model: str, layers: int | None) -> int:
    """NVFP4 bytes of one expert (gate, up, down: codes, block scales, global scales)."""
    cfg = model_config(model, layers)
    h, i = cfg["hidden_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return 3 * (i * h // 2 + i * h // 16 + 4)


def run_load_memory(name: str, ckpt: Path, quantization: str, args, out_dir: Path) -> dict:
    out = out_dir / f"e2e_load_memory_{name}.rows.json"
    engine = engine_kwargs(ckpt, quantization, [8], args.input_len, args.output_len, args.gpu_memory_utilization)
    engine["enforce_eager"] = True  # graph capture comes after loading and would only lengthen the run
    proc = run_runner(LOAD_RUNNER, {"engine": engine, "quantization": quantization, "out": str(out)})
    result = {"path": name, "quantization": quantization}
    if proc.returncode != 0:
        result["error"] = proc.stderr[-4000:]
        print(f"{name} (load memory): FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
        return result
    rows = json.loads(out.read_text())
    moe = [r for r in rows if r["module"] == "RoutedExperts"]  # vLLM 0.26's MoE layer, which holds the quant method
    result.update(
        rows=rows,
        first_moe_peak_extra=moe[0]["peak_extra"] if moe else None,
        other_moe_peak_extra_max=max((r["peak_extra"] for r in moe[1:]), default=None),
        any_layer_peak_extra_max=max((r["peak_extra"] for r in rows), default=None),
    )
    return result


def load_memory_markdown(report: dict) -> str:
    env, a = report["environment"], report["args"]
    one = report["expert_bytes"]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB ({b / one:.1f} experts)"  # noqa: E731
    lines = [
        "# Peak extra GPU memory while process_weights_after_loading repacks the experts",
        "",
        f"Device {env['device']}; vLLM {env['vllm']}, torch {env['torch']}; moe_nvfp4 @ {env['git_commit']}; "
        f"{env['date']}.",
        f"Model: {a['model']} shapes, {report['layers']} layers; one expert = {one / 2**20:.2f} MiB "
        "NVFP4.  Per layer: max_memory_allocated during its call minus what was allocated before it.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| path | first MoE layer | other MoE layers (max) | any layer (max) |",
        "|---|---|---|---|",
    ]
    for r in report["load_memory"]:
        if "error" in r:
            lines.append(f"| {r['path']} | failed | | |")
            continue
        lines.append(
            f"| {r['path']} | {mib(r['first_moe_peak_extra'])} | {mib(r['other_moe_peak_extra_max'])} | "
            f"{mib(r['any_layer_peak_extra_max'])} |"
        )
    return "\n".join(lines) + "\n"


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
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "vllm": version("vllm"),
        "triton": version("triton"),
        "moe_nvfp4": version("moe_nvfp4"),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(report: dict) -> str:
    env, a = report["environment"], report["args"]
    lines = [
        "# vLLM offline generation throughput (output tokens/s)",
        "",
        f"Device {env['device']}; vLLM {env['vllm']}, torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
        f"moe_nvfp4 {env['moe_nvfp4']} @ {env['git_commit']}; {env['date']}.",
        f"Model: {a['model']} shapes, {report['layers']} layers, random weights; input {a['input_len']}, "
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
    starts = [f"{r['path']} {r['engine_start_s']:.0f} s" for r in paths if "engine_start_s" in r]
    if starts:  # a fresh machine's first start also compiles (and, ours with MOE_NVFP4_AUTOTUNE=1, autotunes): plugin_log, start_log in the JSON
        lines += ["", "Engine start (`LLM(...)` until it returns): " + ", ".join(starts) + "."]
    for r in paths:
        if "error" in r:
            lines += ["", f"`{r['path']}` failed: see `error` in the JSON."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's full depth)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/moe_nvfp4_e2e"), help="checkpoints (reused if present)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--load-memory", action="store_true", help="measure the repack's peak extra memory instead")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    layers = args.layers or MODELS[args.model]["layers"]
    ckpts = checkpoints(args.work_dir, args.layers, args.paths, model=args.model)
    report = {
        "environment": environment(),
        "command": "python "
        + " ".join(shlex.quote(x) for x in [str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "layers": layers,
    }
    stem = f"e2e_{args.model}_L{layers}"
    if args.load_memory:
        quantized = [p for p in args.paths if PATHS[p][1] is not None]
        report["expert_bytes"] = expert_bytes(args.model, args.layers)
        report["load_memory"] = [run_load_memory(p, ckpts[PATHS[p][0]], PATHS[p][1], args, args.out) for p in quantized]
        (args.out / f"e2e_load_memory_{args.model}_L{layers}.json").write_text(json.dumps(report, indent=2))
        (args.out / f"e2e_load_memory_{args.model}_L{layers}.md").write_text(load_memory_markdown(report))
        print(load_memory_markdown(report))
        return 0 if all("rows" in r for r in report["load_memory"]) else 1
    # Rows of earlier calls for other paths stay, so one path per call (each a few minutes) builds one table.
    earlier = (
        json.loads((args.out / f"{stem}.json").read_text())["results"] if (args.out / f"{stem}.json").exists() else []
    )
    fresh = [run_path(p, ckpts[PATHS[p][0]], PATHS[p][1], args, args.out) for p in args.paths]
    results = [r for r in earlier if r["path"] not in args.paths] + fresh
    results = report["results"] = sorted(results, key=lambda r: list(PATHS).index(r["path"]))  # columns stay put
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all("rows" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
