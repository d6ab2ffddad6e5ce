"""End-to-end vLLM 0.26 tests of ``--quantization nvfp4_grouped`` on tiny random Mixtral, Qwen3-MoE and DeepSeek-V3
models (DeepSeek-V3: MLA, noaux_tc grouped top-k with a correction bias, a shared expert, a dense first layer and a
routed scaling factor; see tests/helpers_checkpoints.py).

Reference: the same model as a BF16 checkpoint whose expert weights are the dequantized NVFP4 values, run by
vLLM's own BF16 path.  Both compute the same function up to activation rounding, so greedy tokens agree
except where the reference's top-2 log-probabilities are closer than LOGPROB_ATOL (a random tiny model has
near-uniform logits; such steps are ties, not errors).  CUDA graphs stay on (no enforce_eager).

Each LLM runs in a fresh subprocess (vLLM spawns workers and holds the GPU until the process exits).  The
plugin is loaded through its ``vllm.general_plugins`` entry point when the package is installed
(``pip install -e .``); otherwise the runner registers it by hand and forks its workers.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import run_until_written  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["mixtral", "qwen3_moe"]
DEEPSEEK = "deepseek_v3"  # in the reference comparison only: each engine start of it costs a minute or more
MAX_TOKENS = 24
MIN_EQUAL_TOKENS = 8  # tokens that must agree before any tie is allowed
ENGINE_TIMEOUT_S = 900  # engine start (torch.compile, CUDA graphs, our warm-up) and generation
EXIT_GRACE_S = 60  # how long an engine may take to shut down once its results are written
LOGPROB_ATOL = 0.05  # chosen-token log-probabilities: ours vs the dequantized-BF16 reference
PROMPTS = [[1, 17, 42, 99, 7, 3], [5, 200, 13, 77, 128, 9, 31, 64], [250, 2, 3, 4]]

RUNNER = textwrap.dedent(
    """
    import json, os, sys
    args = json.loads(sys.argv[1])
    from importlib.metadata import entry_points
    if "nvfp4_grouped" not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # workers inherit the hand registration
        from moe_nvfp4_vllm.plugin import register
        register()
        print("plugin registered by hand (package not installed)", file=sys.stderr)
    from vllm import LLM, SamplingParams
    extra = dict(args["engine"])  # what a test adds (expert parallel, compilation config, ...)
    if args["tp"] > 1 and "compilation_config" not in extra and (os.environ.get("NCCL_NVLS_ENABLE") == "0"
                           or os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"):
        # vLLM's all-reduce + RMSNorm fusion (FlashInfer, mnnvl backend) needs NVLink multicast; on machines
        # that switch multicast off its TP=2 profile run hits an illegal address (vLLM 0.26.0, 2x H200).
        extra["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    llm = LLM(
        model=args["model"], quantization=args["quantization"], tensor_parallel_size=args["tp"],
        skip_tokenizer_init=True, max_model_len=256, gpu_memory_utilization=args["mem"], seed=0,
        dtype="bfloat16", max_num_seqs=8, **extra,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], logprobs=5, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({
            "tokens": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
        })
    with open(args["out"] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args["out"] + ".tmp", args["out"])  # the test sees the file whole or not at all
    """
)


_RUNS: dict[tuple, list[dict]] = {}  # one engine start per (model, method, TP, extra env) per session
_LOGS: dict[str, str] = {}  # each engine's stderr, by tag


def _run_llm(
    tmp_path: Path,
    model: Path,
    quantization: str | None,
    *,
    tp: int = 1,
    tag: str,
    env_extra: dict[str, str] | None = None,
    engine: dict | None = None,
    prompts: list[list[int]] | None = None,
) -> list[dict]:
    """``engine``: extra ``LLM(...)`` keyword arguments (JSON-serialisable); ``prompts``: token ids (PROMPTS)."""
    prompts = prompts or PROMPTS
    key = (str(model), quantization, tp, tuple(sorted((env_extra or {}).items())), json.dumps([engine, prompts]))
    if key not in _RUNS:
        _RUNS[key] = _start_llm(
            tmp_path,
            model,
            quantization,
            tp=tp,
            tag=tag,
            env_extra=env_extra or {},
            engine=engine or {},
            prompts=prompts,
        )
    return _RUNS[key]


def _start_llm(
    tmp_path: Path,
    model: Path,
    quantization: str | None,
    *,
    tp: int,
    tag: str,
    env_extra: dict[str, str],
    engine: dict | None = None,
    prompts: list[list[int]] = PROMPTS,
) -> list[dict]:
    out = tmp_path / f"{tag}.json"
    args = {
        "model": str(model),
        "quantization": quantization,
        "tp": tp,
        "mem": 0.3,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "out": str(out),
        "engine": engine or {},
    }
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    # Greedy decoding never samples; FlashInfer's top-k/top-p sampler would only be JIT-built (nvcc, a minute or
    # more on a fresh machine, each TP rank waiting on the build) for the engine's warm-up.
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    _LOGS[tag] = run_until_written(
        [sys.executable, "-c", RUNNER, json.dumps(args)],
        env,
        out,
        tag=tag,
        timeout_s=ENGINE_TIMEOUT_S,
        exit_grace_s=EXIT_GRACE_S,
    )
    return json.loads(out.read_text())


def _dequantized_bf16(src: Path, quantized: Path, dst: Path) -> Path:
    """Copy the BF16 source checkpoint, replacing each expert weight with its dequantized NVFP4 value."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moe_nvfp4 import NVFP4Tensor, dequantize_nvfp4

    q = {}
    for f in sorted(quantized.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            q.update({k: h.get_tensor(k) for k in h.keys()})
    shutil.copytree(src, dst)
    replaced = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        for k in list(tensors):
            mod = k.removesuffix(".weight")
            if k.endswith(".weight") and f"{mod}.weight_scale_2" in q:
                w = NVFP4Tensor(q[k], q[f"{mod}.weight_scale"], q[f"{mod}.weight_scale_2"].float().reshape(()))
                tensors[k] = dequantize_nvfp4(w, torch.bfloat16)
                replaced += 1
        save_file(tensors, str(f), metadata={"format": "pt"})
    assert replaced > 0, "no expert weights found in the quantized checkpoint"
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per family: BF16 source, our ModelOpt conversion (separate gate/up scales), CT conversion, reference."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers_checkpoints import make_tiny_checkpoint

    from moe_nvfp4.checkpoint import Convention
    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    root = tmp_path_factory.mktemp("vllm_e2e")
    out = {}
    for family in FAMILIES + [DEEPSEEK]:
        src = make_tiny_checkpoint(family, root / f"{family}-bf16", seed=0)
        modelopt = root / f"{family}-modelopt"
        convert_checkpoint(
            src, modelopt, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False
        )
        ct = root / f"{family}-ct"
        convert_checkpoint(
            src,
            ct,
            ConvertOptions(
                settings=QuantSettings(convention=Convention.COMPRESSED_TENSORS, separate_gate_up_scales=True)
            ),
            progress=False,
        )
        ref = _dequantized_bf16(src, modelopt, root / f"{family}-dequantized-bf16")
        out[family] = {"bf16": src, "modelopt": modelopt, "ct": ct, "ref": ref}
    return out


def _compare(ours: list[dict], ref: list[dict], what: str) -> None:
    for p, (o, r) in enumerate(zip(ours, ref)):
        for step, (to, tr) in enumerate(zip(o["tokens"], r["tokens"])):
            lp_ref = r["logprobs"][step]
            lp_ours = o["logprobs"][step]
            if to != tr:
                margin = lp_ref[str(tr)] - lp_ref.get(str(to), -float("inf"))
                assert step >= MIN_EQUAL_TOKENS or margin <= 2 * LOGPROB_ATOL, (
                    f"{what}: prompt {p} diverges at token {step}: ours {to}, reference {tr} "
                    f"(reference margin {margin:.4f})"
                )
                break  # the sequences now differ; later steps are not comparable
            assert abs(lp_ours[str(to)] - lp_ref[str(tr)]) <= LOGPROB_ATOL, (
                f"{what}: prompt {p} token {step}: log-prob {lp_ours[str(to)]:.4f} vs reference {lp_ref[str(tr)]:.4f}"
            )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["modelopt", "ct"])
def test_greedy_tokens_match_dequantized_bf16(tmp_path, checkpoints, family, form):
    ckpt = checkpoints[family]
    ref = _run_llm(tmp_path, ckpt["ref"], None, tag=f"{family}-ref")
    ours = _run_llm(tmp_path, ckpt[form], "nvfp4_grouped", tag=f"{family}-{form}")
    _compare(ours, ref, f"{family} {form}")


def test_deepseek_v3_greedy_tokens_match_dequantized_bf16(tmp_path, checkpoints):
    """DeepSeek-V3 family through vLLM's MLA attention and grouped top-k router: our converter's ModelOpt form
    against the dequantized-BF16 checkpoint on vLLM's BF16 MoE, same bounds as the other families."""
    ckpt = checkpoints[DEEPSEEK]
    ref = _run_llm(tmp_path, ckpt["ref"], None, tag=f"{DEEPSEEK}-ref")
    ours = _run_llm(tmp_path, ckpt["modelopt"], "nvfp4_grouped", tag=f"{DEEPSEEK}-modelopt")
    _compare(ours, ref, f"{DEEPSEEK} modelopt")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_quantized_on_load(tmp_path, checkpoints, family):
    """Online quantization of the BF16 source equals the converter's output (both separate gate/up scales)."""
    ckpt = checkpoints[family]
    online = _run_llm(tmp_path, ckpt["bf16"], "nvfp4_grouped", tag=f"{family}-online")
    offline = _run_llm(tmp_path, ckpt["modelopt"], "nvfp4_grouped", tag=f"{family}-offline")
    assert [o["tokens"] for o in online] == [o["tokens"] for o in offline]


@pytest.mark.parametrize("family", FAMILIES)
def test_warp_specialized_gemms_in_vllm(tmp_path, checkpoints, family):
    """The Gluon warp-specialized GEMMs (sm90.gemm_gluon) inside vLLM, under torch.compile and CUDA graphs: a
    tuned-config directory that selects them for the tiny model's shape at every token count (the shipped
    configs hold no entry for it, so the other tests run the Triton kernel), and a fresh Triton cache that
    must then hold their compiled kernel; greedy tokens match the dequantized-BF16 reference as there.  GEMM2
    runs as two K groups per tile (the tile's K step goes to each group in turn from tile to tile)."""
    from helpers_checkpoints import EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, TOP_K

    from moe_nvfp4.sm90.configs import CONFIG_VERSION, KERNEL_NAME, MoEKernelConfig
    from moe_nvfp4.sm90.tuned_configs import config_path

    ws = {"block_n": 64, "num_stages": 2, "programs_per_sm": 2, "max_registers": 128, "warp_specialized": True}
    config = {"block_m": 16, "gemm1": ws, "gemm2": {**ws, "programs_per_sm": 1, "max_registers": 168, "k_groups": 2}}
    assert MoEKernelConfig.from_dict(config).is_valid(128, 128)
    entry = dict(
        experts=EXPERTS,
        top_k=TOP_K,
        hidden=HIDDEN,
        intermediate=EXPERT_INTERMEDIATE,
        dtype="bfloat16",
        max_tokens=1 << 20,
        config=config,
    )
    path = config_path(torch.cuda.get_device_name(), tmp_path / "configs")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": {"kernel": KERNEL_NAME, "version": CONFIG_VERSION}, "entries": [entry]}))
    cache = tmp_path / "triton-cache"
    # autotuning off: the file's entry, not a measured neighbour of it, is what runs
    env = {"MOE_NVFP4_CONFIG_DIR": str(tmp_path / "configs"), "TRITON_CACHE_DIR": str(cache), "MOE_NVFP4_AUTOTUNE": "0"}
    ckpt = checkpoints[family]
    ref = _run_llm(tmp_path, ckpt["ref"], None, tag=f"{family}-ref")
    ours = _run_llm(tmp_path, ckpt["modelopt"], "nvfp4_grouped", tag=f"{family}-ws", env_extra=env)
    assert any(p.name.startswith("_moe_gemm_ws_kernel") for p in cache.rglob("*")), "the Gluon GEMM never compiled"
    _compare(ours, ref, f"{family} warp-specialized")


@pytest.mark.parametrize("family", FAMILIES)
def test_autotune_at_load_logs_its_choice_and_a_second_start_reads_the_cache(tmp_path, checkpoints, family):
    """Autotuning at load, asked for (MOE_NVFP4_AUTOTUNE=1; off by default since design 004 decision 10): the engine
    logs what it chose and how long it took, writes its cache, and generates the reference's tokens; a second engine
    on the same cache reads the choice instead of timing."""
    cache = tmp_path / "autotune-cache"
    env = {
        "MOE_NVFP4_CACHE_DIR": str(cache),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # the log is read here
        "MOE_NVFP4_AUTOTUNE": "1",
    }
    ckpt = checkpoints[family]
    ref = _run_llm(tmp_path, ckpt["ref"], None, tag=f"{family}-ref")
    first = _run_llm(tmp_path, ckpt["modelopt"], "nvfp4_grouped", tag=f"{family}-autotune", env_extra=env)
    tuned = [line for line in _LOGS[f"{family}-autotune"].splitlines() if "nvfp4_grouped: autotune" in line]
    assert tuned and "timings over" in tuned[0] and " s;" in tuned[0], _LOGS[f"{family}-autotune"][-3000:]
    assert list(cache.rglob("*.json")), "no autotune cache written"
    _compare(first, ref, f"{family} autotuned")
    second = _start_llm(
        tmp_path, ckpt["modelopt"], "nvfp4_grouped", tp=1, tag=f"{family}-autotune-again", env_extra=env
    )  # a second engine start, not the cached run
    again = [line for line in _LOGS[f"{family}-autotune-again"].splitlines() if "nvfp4_grouped: autotune" in line]
    assert again and "configs from cache" in again[0], _LOGS[f"{family}-autotune-again"][-3000:]
    assert [o["tokens"] for o in second] == [o["tokens"] for o in first]


# ---- issue 42's families: non-gated ReLU² (NemotronH), router weight on the input (Llama-4), biases + swigluoai (gpt-oss)

_FAMILY_CHECKPOINTS: dict[str, dict[str, Path]] = {}  # built on first use, so `-k nemotron` builds only NemotronH


def _dequantize_stacked(src_tensors: dict, q: dict, prefix: str) -> dict:
    """Llama-4's stacked, transposed experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]) rebuilt from the
    converter's per-expert NVFP4 modules ``<prefix>.<e>.gate_proj|up_proj|down_proj``."""
    from moe_nvfp4 import NVFP4Tensor, dequantize_nvfp4

    def deq(module):
        return dequantize_nvfp4(
            NVFP4Tensor(
                q[f"{module}.weight"], q[f"{module}.weight_scale"], q[f"{module}.weight_scale_2"].float().reshape(())
            ),
            torch.bfloat16,
        )

    experts = src_tensors[f"{prefix}.gate_up_proj"].shape[0]
    gate_up = torch.stack(
        [torch.cat([deq(f"{prefix}.{e}.gate_proj"), deq(f"{prefix}.{e}.up_proj")]).T for e in range(experts)]
    )
    down = torch.stack([deq(f"{prefix}.{e}.down_proj").T for e in range(experts)])
    return {f"{prefix}.gate_up_proj": gate_up.contiguous(), f"{prefix}.down_proj": down.contiguous()}


def _rewrite_tensors(src: Path, dst: Path, fn) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with each shard's tensors passed through ``fn`` (dict -> replacements)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    replaced = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        new = fn(tensors)
        replaced += len(new)
        save_file({**tensors, **new}, str(f), metadata={"format": "pt"})
    assert replaced > 0, f"{src}: no expert tensors replaced"
    return dst


def _llama4_reference(src: Path, quantized: Path, dst: Path) -> Path:
    from safetensors import safe_open

    q = {}
    for f in sorted(quantized.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            q.update({k: h.get_tensor(k) for k in h.keys()})

    def replace(tensors):
        out = {}
        for name in tensors:
            if name.endswith(".experts.gate_up_proj"):
                out.update(_dequantize_stacked(tensors, q, name.removesuffix(".gate_up_proj")))
        return out

    return _rewrite_tensors(src, dst, replace)


def _gpt_oss_reference(src: Path, dst: Path) -> Path:
    """gpt-oss's experts as nvfp4_grouped quantizes them on load: gate/up de-interleaved, each expert's gate and up
    with their own global scale, down per expert; dequantized and written back in gpt-oss's layout."""
    from moe_nvfp4 import dequantize_nvfp4, quantize_nvfp4

    def replace(tensors):
        out = {}
        for name, t in tensors.items():
            if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I], column 2i gate i, 2i + 1 up i
                rows = t.transpose(1, 2)
                w13 = torch.cat([rows[:, 0::2], rows[:, 1::2]], 1)
                deq = dequantize_nvfp4(quantize_nvfp4(w13, segments=2), torch.bfloat16)
                gate, up = deq.chunk(2, dim=1)
                out[name] = torch.stack([gate, up], 2).flatten(1, 2).transpose(1, 2).contiguous()
            elif name.endswith(".experts.down_proj"):  # [E, I, H]
                deq = dequantize_nvfp4(quantize_nvfp4(t.transpose(1, 2)), torch.bfloat16)
                out[name] = deq.transpose(1, 2).contiguous()
        return out

    return _rewrite_tensors(src, dst, replace)


def _family_checkpoint(tmp_path_factory, family: str) -> dict[str, Path]:
    """NemotronH / Llama-4: BF16 source, our ModelOpt conversion, its dequantized-BF16 reference; gpt-oss (which the
    converter refuses, see moe_nvfp4.convert.plan.GPT_OSS_REFUSAL): BF16 source and the reference of its online
    quantization."""
    if family not in _FAMILY_CHECKPOINTS:
        sys.path.insert(0, str(REPO / "tests"))
        from helpers_checkpoints import make_tiny_checkpoint

        from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

        root = tmp_path_factory.mktemp(f"vllm_e2e_{family}")
        src = make_tiny_checkpoint(family, root / "bf16", seed=0)
        if family == "gpt_oss":
            _FAMILY_CHECKPOINTS[family] = {"bf16": src, "ref": _gpt_oss_reference(src, root / "dequantized-bf16")}
        else:
            modelopt = root / "modelopt"
            convert_checkpoint(
                src, modelopt, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False
            )
            reference = _llama4_reference if family == "llama4_text" else _dequantized_bf16
            _FAMILY_CHECKPOINTS[family] = {
                "bf16": src,
                "modelopt": modelopt,
                "ref": reference(src, modelopt, root / "dequantized-bf16"),
            }
    return _FAMILY_CHECKPOINTS[family]


@pytest.mark.parametrize(
    ("family", "form"),
    [("nemotron_h", "modelopt"), ("llama4_text", "modelopt"), ("gpt_oss", "bf16")],
    ids=["nemotron_h-relu2", "llama4-router-weight-on-input", "gpt_oss-biases-swigluoai"],
)
def test_issue42_family_greedy_tokens_match_dequantized_bf16(tmp_path, tmp_path_factory, family, form):
    """One engine of ours and one of vLLM's BF16 path per family, same bounds as the families above: NemotronH
    (relu2_no_mul, no Mamba layer, sigmoid grouped top-k with correction bias, shared expert) and Llama-4 text (top-1
    sigmoid routing, router weight applied to the expert input, shared expert) from the converter's ModelOpt form;
    gpt-oss (swigluoai with clamp, expert biases, interleaved gate/up) quantized on load from its BF16 checkpoint."""
    ckpt = _family_checkpoint(tmp_path_factory, family)
    ref = _run_llm(tmp_path, ckpt["ref"], None, tag=f"{family}-ref")
    ours = _run_llm(tmp_path, ckpt[form], "nvfp4_grouped", tag=f"{family}-{form}")
    _compare(ours, ref, f"{family} {form}")


# Eight prompts of 40 tokens: a prefill of 320 tokens, 160 rows an expert of the tiny models (4 experts, top-2), past
# the W4A8 mode's 80 (sm90.w4a8.FP8_MIN_ROWS_PER_EXPERT); decode (8 tokens) stays W4A16.  The prefill runs in a CUDA
# graph captured at 320 tokens (max_num_seqs=8 alone captures up to 16): an eager forward of these tiny layers stays
# W4A16 (w4a8.FP8_MIN_EAGER_FLOPS), a captured one runs W4A8 from the rows bound.
LONG_PROMPTS = [[(7 * p + 13 * j) % 250 + 1 for j in range(40)] for p in range(8)]
LONG_PROMPT_GRAPHS = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 320]}}
W4A8_TIE = 0.5  # W4A16's top-2 log-probability gap under which W4A8 (6e-2 from float64 a layer) may pick the other


@pytest.mark.parametrize("family", FAMILIES)
def test_w4a8_mode_in_vllm(tmp_path, checkpoints, family):
    """MOE_NVFP4_FP8_ACTIVATIONS=1 (design 008's opt-in W4A8 mode): the engine folds the e4m3 copy at load (its log
    says so) and the 320-token prefill, captured in a CUDA graph, runs W4A8 (it moves the log-probabilities).  Against the same checkpoint without it, every prompt's first
    greedy token agrees unless W4A16's top two are within W4A8_TIE; the agreement over all tokens is printed."""
    ckpt = checkpoints[family]["modelopt"]
    long = dict(prompts=LONG_PROMPTS, engine=LONG_PROMPT_GRAPHS)
    base = _run_llm(tmp_path, ckpt, "nvfp4_grouped", tag=f"{family}-long", **long)
    env = {"MOE_NVFP4_FP8_ACTIVATIONS": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # the log is read here
    w4a8 = _run_llm(tmp_path, ckpt, "nvfp4_grouped", tag=f"{family}-w4a8", env_extra=env, **long)
    assert "W4A8 mode on" in _LOGS[f"{family}-w4a8"], _LOGS[f"{family}-w4a8"][-3000:]
    # the W4A8 roundings move the first token's log-probability (W4A16 against itself is bit for bit the same)
    moved = [
        ours["logprobs"][0].get(str(ref["tokens"][0])) != ref["logprobs"][0][str(ref["tokens"][0])]
        for ours, ref in zip(w4a8, base)
    ]
    assert any(moved), f"{family}: no first-token log-probability moved: the 320-token prefill did not run W4A8"
    same = total = 0
    for p, (ours, ref) in enumerate(zip(w4a8, base)):
        first, ref_first = ours["tokens"][0], ref["tokens"][0]
        lp = ref["logprobs"][0]
        margin = lp[str(ref_first)] - lp.get(str(first), -float("inf"))
        assert first == ref_first or margin <= W4A8_TIE, (
            f"{family} prompt {p}: W4A8 {first}, W4A16 {ref_first} ({margin:.3f})"
        )
        for a, b in zip(ours["tokens"], ref["tokens"]):
            total += 1
            if a != b:
                break
            same += 1
    print(f"{family}: W4A8 follows W4A16 for {same} of {total} greedy tokens (up to each prompt's first difference)")
