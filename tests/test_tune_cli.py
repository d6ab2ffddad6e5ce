"""``moe-nvfp4 tune`` (moe_nvfp4.tune_cli) on the CPU: shapes from config.json (model directories written with
transformers' own configs and ``save_pretrained``), per-rank shapes, refusals, and a whole run with a stand-in for
the GPU timing, whose cache is the one a vLLM start then reads (``autotune.cached_configs``, what the plugin runs at
load by default).  The GPU test is tests/gpu/test_tune_cli_gpu.py.

No tolerances: shapes, cache contents, exit statuses and call counts are exact.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import moe_nvfp4.sm90.autotune as autotune
import moe_nvfp4.sm90.tuned_configs as tuned_configs
import moe_nvfp4.tune_cli as tune_cli
from moe_nvfp4.cli import main
from moe_nvfp4.expert_activation import RELU2, SILU, SWIGLU_OAI
from moe_nvfp4.shapes import DeviceTraits, LayerShape
from moe_nvfp4.sm90.autotune import cache_key, cache_path, neighbours
from moe_nvfp4.sm90.tuned_configs import select_config
from moe_nvfp4.tune_cli import TuneShape, per_rank, shapes_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers_checkpoints import EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, TOP_K, tiny_config  # noqa: E402

H200 = DeviceTraits("NVIDIA H200", (9, 0), 132, 141)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Nothing measured in this process; no tuned files; the autotune cache under tmp_path."""
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path / "no-configs")
    monkeypatch.setenv("MOE_NVFP4_CACHE_DIR", str(tmp_path / "cache"))
    tuned_configs._tuned_entries.cache_clear()
    yield
    tuned_configs._tuned_entries.cache_clear()


# (family, experts, top-k, activation, biases): what vLLM builds each family's routed experts with
FAMILIES = [
    ("mixtral", EXPERTS, TOP_K, SILU, False),
    ("qwen3_moe", EXPERTS, TOP_K, SILU, False),
    ("deepseek_v3", 8, TOP_K, SILU, False),  # n_routed_experts
    ("nemotron_h", EXPERTS, TOP_K, RELU2, False),  # ReLU^2, not gated
    ("llama4_text", EXPERTS, 1, SILU, False),
    ("gpt_oss", EXPERTS, TOP_K, SWIGLU_OAI, True),  # clamped SwiGLU with expert biases
]


@pytest.mark.parametrize("family,experts,top_k,activation,biases", FAMILIES)
def test_shapes_from_a_saved_config(tmp_path, family, experts, top_k, activation, biases) -> None:
    tiny_config(family).save_pretrained(tmp_path / family)
    (shape,) = shapes_from_config(tmp_path / family)
    assert (shape.experts, shape.top_k, shape.hidden, shape.intermediate) == (
        experts,
        top_k,
        HIDDEN,
        EXPERT_INTERMEDIATE,
    )
    assert (shape.activation, shape.biases, shape.dtype) == (activation, biases, "bfloat16")
    assert shape.layer == LayerShape(experts, top_k, HIDDEN, EXPERT_INTERMEDIATE, "bfloat16", gated=activation.gated)


def test_a_multimodal_config_is_read_through_its_text_config(tmp_path) -> None:
    from transformers import Llama4Config

    Llama4Config(text_config=tiny_config("llama4_text").to_dict()).save_pretrained(tmp_path)
    (shape,) = shapes_from_config(tmp_path)
    assert (shape.experts, shape.top_k, shape.hidden, shape.intermediate) == (EXPERTS, 1, HIDDEN, EXPERT_INTERMEDIATE)


@pytest.mark.parametrize(
    "written,requested,dtype",
    [("float16", "auto", "float16"), ("float32", "auto", "bfloat16"), ("bfloat16", "float16", "float16")],
)
def test_the_activation_dtype_follows_vllms_auto(tmp_path, written, requested, dtype) -> None:
    config = tiny_config("mixtral").to_dict()
    config["torch_dtype"] = written
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert shapes_from_config(tmp_path, dtype=requested)[0].dtype == dtype


def test_dbrx_reads_its_ffn_config(tmp_path) -> None:
    config = {
        "model_type": "dbrx",
        "d_model": 6144,
        "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (shape,) = shapes_from_config(tmp_path)
    assert (shape.experts, shape.top_k, shape.hidden, shape.intermediate) == (16, 4, 6144, 10752)


def test_per_rank_shapes_are_what_the_plugin_keys_its_cache_by() -> None:
    qwen = TuneShape("qwen3", 128, 8, 2048, 768)
    assert per_rank(qwen, tp=4).layer == LayerShape(128, 8, 2048, 192)
    ep = per_rank(qwen, ep=8)
    assert ep.layer == LayerShape(16, 8, 2048, 768, global_experts=128) and ep.name == "qwen3 EP8"
    assert per_rank(qwen) == qwen


@pytest.mark.parametrize(
    "tp,ep,match", [(5, 1, "768 / 5"), (64, 1, "768 / 64"), (1, 3, "128 experts"), (2, 2, "not both"), (0, 1, ">= 1")]
)
def test_splits_the_plugin_would_refuse_are_refused(tp, ep, match) -> None:
    with pytest.raises(ValueError, match=match):
        per_rank(TuneShape("qwen3", 128, 8, 2048, 768), tp=tp, ep=ep)


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "give a model directory or --shape"),
        (["DIR", "--shape", "16,4,512,256"], "give a model directory or --shape"),
        (["--shape", "16,4,512"], "four integers"),
        (["--shape", "16,32,512,256"], "top-k K=32"),
        (["--shape", "16,4,500,256"], "hidden H=500"),
        (["DIR", "--activation", "relu2"], "--activation is for --shape"),
        (["--shape", "16,4,512,256", "--max-tokens", "0"], "--max-tokens 0"),
        (["--shape", "16,4,512,256", "--budget-s", "0"], "--budget-s 0"),
        (["--shape", "16,4,512,256", "--tp", "32"], "256 / 32"),
        (["NOWHERE"], "no config.json there"),
        (["NOMOE"], "no MoE layer"),
        (["--shape", "16,4,512,256"], "sees no CUDA GPU"),  # a run that would time needs a GPU
    ],
)
def test_bad_arguments_get_one_line_and_status_2(tmp_path, capsys, monkeypatch, argv, message) -> None:
    import torch
    from transformers import LlamaConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host: no case may start timing

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(tmp_path / "NOMOE")
    tiny_config("mixtral").save_pretrained(tmp_path / "DIR")
    argv = [str(tmp_path / a) if a in ("DIR", "NOWHERE", "NOMOE") else a for a in argv]
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-nvfp4 tune: error: ") and message in err and "\n" not in err, err


def test_tp_and_ep_together_are_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--shape", "16,4,512,256", "--tp", "2", "--ep", "2"])
    assert exit_.value.code == 2 and "not allowed with argument --tp" in capsys.readouterr().err


def test_dry_run_lists_the_rank_shapes_without_a_gpu(tmp_path, capsys) -> None:
    tiny_config("qwen3_moe").save_pretrained(tmp_path / "qwen")
    assert main(["tune", str(tmp_path / "qwen"), "--ep", "2", "--dry-run", "--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert f"E={EXPERTS // 2} of {EXPERTS} top-{TOP_K} H={HIDDEN} I={EXPERT_INTERMEDIATE} bfloat16 silu" in out
    assert "up to 512 tokens" in out and str(tmp_path / "cache" / "autotune") in out


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """A GPU that is an H200 whose timings are ``costs`` (default 100 us); records what was timed."""
    timed: list = []
    costs: dict = {}

    def measure(cfg, tokens):
        timed.append((cfg, tokens))
        return costs.get(cfg, 100.0)

    monkeypatch.setattr(tune_cli, "_check_gpu", lambda: None)
    monkeypatch.setattr(tune_cli, "gpu_measure", lambda shape, stack: (H200, measure))
    return timed, costs


def test_a_tune_writes_the_cache_a_vllm_start_then_serves(tmp_path, capsys, monkeypatch, stand_in_gpu) -> None:
    """Tune a 2-rank EP shape of a saved model: the cache file is where and how the plugin's load step looks for it,
    the summary says what changed, and a new process serves exactly those entries without timing; a second run
    reads the cache and times nothing; --force times again."""
    timed, costs = stand_in_gpu
    tiny_config("qwen3_moe").save_pretrained(tmp_path / "qwen")
    rank = LayerShape(EXPERTS // 2, TOP_K, HIDDEN, EXPERT_INTERMEDIATE, global_experts=EXPERTS)
    winner = neighbours(select_config(64, rank, H200), 64, rank)[1]
    costs[winner] = 50.0
    argv = ["tune", str(tmp_path / "qwen"), "--ep", "2", "--max-tokens", "1024", "--budget-s", "30"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    path = cache_path(cache_key(rank, H200), tmp_path / "cache" / "autotune")
    assert path.exists() and f"cache {path}" in out and "1 changed (T<=64 100.0->50.0 us)" in out, out
    assert "T <= 64: 100.0 -> 50.0 us" in out and "T <= 1024: 100.0 us, kept" in out, out
    assert "qwen (qwen3_moe) EP2: " in err and " of 30 s, T=" in err, err  # the progress bar
    data = json.loads(path.read_text())
    assert data["key"] == cache_key(rank, H200) and data["max_tokens"] == 1024
    assert {(e["experts"], e["global_experts"]) for e in data["entries"]} == {(EXPERTS // 2, EXPERTS)}

    monkeypatch.setattr(tuned_configs, "_MEASURED", {})  # vllm serve: a new process, autotuning off (the default)
    monkeypatch.delenv(autotune.SWITCH_ENV, raising=False)
    start = autotune.cached_configs(rank, H200, 1024)
    assert start.source == "cache" and select_config(64, rank, H200) == winner
    assert tuned_configs.measured_entries(rank, H200) == data["entries"]

    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    timed.clear()
    assert main(argv) == 0
    assert timed == [] and "configs from cache" in capsys.readouterr().out
    assert main([*argv, "--force", "--quiet"]) == 0
    assert {t for _, t in timed} == set(autotune.token_buckets(1024, rank, H200))


def test_a_tune_of_a_shape_flag_matches_the_demo_spelling(tmp_path, capsys, stand_in_gpu) -> None:
    timed, _ = stand_in_gpu
    assert main(["tune", "--shape", "16, 4, 512, 256", "--activation", "relu2", "--max-tokens", "64", "--quiet"]) == 0
    shape = LayerShape(16, 4, 512, 256, gated=False)
    assert cache_path(cache_key(shape, H200), tmp_path / "cache" / "autotune").exists()
    assert {t for _, t in timed} == set(autotune.token_buckets(64, shape, H200))
    assert "--shape 16,4,512,256: E=16 top-4 H=512 I=256 bfloat16 relu2" in capsys.readouterr().out
