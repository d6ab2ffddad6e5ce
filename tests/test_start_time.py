"""benchmarks/start_time.py on the CPU, so a GPU lease never finds its defects: the phases it reads from vLLM's log
lines, fresh caches for every first start and kept ones for --warm, starts of several calls (one path per GPU)
merged into one table, failures shown, and its runner script itself run against a stand-in vLLM.

No tolerances: parsed seconds are the logged ones, table cells exact strings.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_throughput as e2e  # noqa: E402
import start_time  # noqa: E402

ENV = {
    "device": "NVIDIA H200",
    "torch": "2.11",
    "cuda": "12.9",
    "vllm": "0.26.0",
    "triton": "3.6.0",
    "moe_nvfp4": "0.1.0",
    "git_commit": "abc",
    "date": "2026-11-28",
}
PREFIX = "(EngineCore_DP0 pid=4242) INFO 11-28 10:00:00 "
LOG = [  # what vLLM 0.26 and the plugin log during a start of ours (two layer shapes warmed)
    PREFIX + "[default_loader.py:431] Loading weights took 5.25 seconds",
    PREFIX + "[moe_method.py:312] nvfp4_grouped: autotune E=16 top-4 H=512 I=256 bfloat16 on NVIDIA H200: 44 timings "
    "over 10 buckets in 50.50 s; 1 changed (T<=16 20.0->18.0 us); cache /c/x.json",
    PREFIX + "[moe_method.py:318] nvfp4_grouped: compiled MoE kernels for token counts [1, 3] (up to 8192) in 14.7 s, "
    "8 threads",
    PREFIX
    + "[moe_method.py:318] nvfp4_grouped: compiled MoE kernels for token counts [1] (up to 8192) in 0.3 s, 8 threads",
    PREFIX + "[gpu_model_runner.py:5348] Model loading took 17.5 GiB memory and 72.250000 seconds",
    PREFIX + "[backends.py:394] Compiling a graph for compile range (1, 8192) takes 20.10 s",
    PREFIX + "[monitor.py:20] torch.compile took 27.45 s in total",
    PREFIX + "[monitor.py:82] Initial profiling/warmup run took 0.31 s",
    PREFIX + "[gpu_model_runner.py:6845] Graph capturing finished in 12 secs, took 0.50 GiB",
    PREFIX + "[core.py:341] init engine (profile, create kv cache, warmup model) took 60.20 s (compilation: 27.45 s)",
]


def test_phases_are_read_from_vllms_lines_and_the_plugins_are_summed() -> None:
    phases = start_time.parse_phases(LOG)
    assert phases == {
        "weights_s": 5.25,
        "autotune_s": 50.5,
        "warmup_s": 15.0,
        "model_loading_s": 72.25,
        "torch_compile_s": 27.45,
        "profiling_s": 0.31,
        "cuda_graphs_s": 12.0,
        "init_engine_s": 60.2,
        "init_repack_s": 1.5,
    }
    other = [
        "INFO Model loading took 5.5 GiB and 8.0 seconds",
        "INFO Loading weights took 2.0 seconds",
        "INFO torch.compile takes 24.9 s in total",
    ]  # the other runner's and older releases' spellings
    assert start_time.parse_phases(other) == {
        "model_loading_s": 8.0,
        "weights_s": 2.0,
        "torch_compile_s": 24.9,
        "init_repack_s": 6.0,
    }
    assert start_time.parse_phases(["INFO nvfp4_grouped: autotune E=16 ...: configs from cache (/c/x.json)"]) == {}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Checkpoints, environment and engine starts stood in for: each start fills its cache directories, takes
    100 s (ours) or 80 s (Marlin) plus its number, and fails while ``fail`` holds True; the specs are kept."""
    specs: list[dict] = []
    fail = [False]
    seconds = {"nvfp4_grouped": 100.0, "modelopt_fp4": 80.0}
    monkeypatch.setattr(start_time, "checkpoints", lambda *a: {"modelopt": tmp_path / "fp4", "bf16": tmp_path / "bf16"})
    monkeypatch.setattr(e2e, "environment", lambda: ENV)

    def run(runner, spec):
        assert runner == start_time.RUNNER
        specs.append(spec)
        for name in start_time.CACHE_ENV:  # what a start leaves behind
            Path(spec["env"][name]).mkdir(parents=True, exist_ok=True)
            (Path(spec["env"][name]) / f"entry{len(specs)}").write_text("x")
        if not fail[0]:
            Path(spec["out"]).write_text(
                json.dumps({"engine_start_s": seconds[spec["quantization"]] + len(specs), "first_generate_s": 0.5})
            )
        log = "\n".join(LOG) if spec["quantization"] == "nvfp4_grouped" else LOG[0]
        return Namespace(returncode=1 if fail[0] else 0, stdout=log, stderr="Traceback: engine died")

    monkeypatch.setattr(e2e, "run_runner", run)
    return specs, fail


def test_first_starts_get_fresh_caches_and_calls_merge_into_one_table(tmp_path, stand_in) -> None:
    specs, fail = stand_in
    out = tmp_path / "out"
    common = ["--model", "qwen3-30b-a3b", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    assert start_time.main([*common, "--paths", "ours", "--repeats", "2"]) == 0
    assert start_time.main([*common, "--paths", "vllm_modelopt_fp4", "--repeats", "1"]) == 0  # another GPU's call
    roots = [{spec["env"][name] for name in start_time.CACHE_ENV} for spec in specs]
    assert all(len(r) == len(start_time.CACHE_ENV) for r in roots) and not set.intersection(*roots)  # never shared
    assert all(spec["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0" for spec in specs)
    first = specs[0]["engine"]
    assert (first["quantization"], first["max_num_batched_tokens"], first["max_num_seqs"]) == (
        "nvfp4_grouped",
        8192,
        1024,
    )
    assert "max_model_len" not in first and specs[2]["engine"]["quantization"] == "modelopt_fp4"
    report = json.loads((out / "start_qwen3-30b-a3b_L48.json").read_text())
    assert [(r["label"], r["mode"], len(r["starts"])) for r in report["results"]] == [
        ("ours", "first", 2),
        ("vllm_modelopt_fp4", "first", 1),
    ]
    ours = report["results"][0]["starts"][0]
    assert (ours["warmup_s"], ours["init_repack_s"], ours["first_generate_s"]) == (15.0, 1.5, 0.5)
    assert any("compiled MoE kernels" in line for line in ours["log"])
    table = (out / "start_qwen3-30b-a3b_L48.md").read_text()
    assert "| ours | first | 2 | 101.5 (101.0-102.0) | 5.2 (5.2-5.2) | 1.5 (1.5-1.5) | 50.5 (50.5-50.5) |" in table, (
        table
    )
    assert "| vllm_modelopt_fp4 | first | 1 | 83.0 | 5.2 | - | - | - |" in table and "| 1.22x |" in table, table
    assert "NVIDIA H200; vLLM 0.26.0" in table and "--paths ours --repeats 2`" in table

    fail[0] = True  # a later call appends; a failed start is counted and fails the call
    assert start_time.main([*common, "--paths", "ours", "--repeats", "1"]) == 1
    table = (out / "start_qwen3-30b-a3b_L48.md").read_text()
    assert "| ours | first | 2 (1 failed) | 101.5 (101.0-102.0) |" in table, table
    fail[0] = False
    assert start_time.main([*common, "--paths", "ours", "--repeats", "1", "--reset"]) == 0
    assert "| ours | first | 1 | 105.0 |" in (out / "start_qwen3-30b-a3b_L48.md").read_text()


def test_warm_starts_reuse_one_filled_cache_per_path_and_variants_stay_apart(tmp_path, stand_in) -> None:
    specs, _ = stand_in
    common = ["--model", "tiny", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--warm"]
    assert (
        start_time.main(
            [*common, "--paths", "ours", "--repeats", "2", "--variant", "serial", "--env", "MOE_NVFP4_WARMUP_THREADS=1"]
        )
        == 0
    )
    assert len(specs) == 3  # one unrecorded start fills the caches, then two on them
    assert len({spec["env"]["TRITON_CACHE_DIR"] for spec in specs}) == 1
    assert all(spec["env"]["MOE_NVFP4_WARMUP_THREADS"] == "1" for spec in specs)
    assert start_time.main([*common, "--paths", "ours", "--repeats", "1"]) == 0
    assert specs[-1]["env"]["TRITON_CACHE_DIR"] != specs[0]["env"]["TRITON_CACHE_DIR"]  # a variant's own caches
    report = json.loads((tmp_path / "out" / "start_tiny_L4.json").read_text())
    assert [(r["label"], r["mode"], len(r["starts"])) for r in report["results"]] == [
        ("ours", "warm", 1),
        ("ours-serial", "warm", 2),
    ]


def test_bad_arguments_are_refused(tmp_path, capsys) -> None:
    for argv, message in ((["--repeats", "0"], "--repeats 0"), (["--env", "NOEQUALS"], "KEY=VALUE")):
        with pytest.raises(SystemExit):
            start_time.main([*argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err


FAKE_VLLM = """
import os
class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens
class LLM:
    def __init__(self, **kw):
        assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and os.environ["TRITON_CACHE_DIR"].endswith("triton_cache_dir")
        assert kw["max_num_batched_tokens"] == 8192
        print("INFO [default_loader.py:431] Loading weights took 0.98 seconds", flush=True)
        print("INFO [monitor.py:20] torch.compile took 27.45 s in total", flush=True)
        print("INFO some other line", flush=True)
    def generate(self, prompts, params, use_tqdm=False):
        return [type("R", (), {"outputs": [type("C", (), {"token_ids": list(range(params.max_tokens))})()]})()]
"""


def test_the_runner_script_writes_what_run_start_reads(tmp_path, monkeypatch) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = Namespace(env=[], gpu_memory_utilization=0.5)
    result = start_time.run_start("vllm_modelopt_fp4", tmp_path / "ckpt", tmp_path / "caches", args)
    assert "error" not in result, result.get("error")
    assert result["engine_start_s"] >= 0 and result["first_generate_s"] >= 0
    assert (result["weights_s"], result["torch_compile_s"]) == (0.98, 27.45) and len(result["log"]) == 2
    assert os.path.isdir(tmp_path / "caches")


def test_the_tiny_model_is_converted_by_our_converter_and_reused(tmp_path) -> None:
    """TINY's layer shape as our converter writes it (inspect finds nothing wrong); a second call rewrites nothing."""
    from moe_nvfp4.convert import inspect_checkpoint

    ckpts = start_time.write_tiny_checkpoint(tmp_path, 1)
    report = inspect_checkpoint(ckpts["modelopt"])
    assert report.ok and not report.problems, str(report)
    t = start_time.TINY
    assert report.experts_per_layer == {"model.layers.0.mlp.experts": t["experts"]}
    assert report.shapes["down"] == (t["hidden"], t["intermediate"])
    mtime = (ckpts["modelopt"] / "config.json").stat().st_mtime_ns
    assert start_time.write_tiny_checkpoint(tmp_path, 1) == ckpts
    assert (ckpts["modelopt"] / "config.json").stat().st_mtime_ns == mtime
