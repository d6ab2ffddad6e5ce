"""The end-to-end benchmarks on the CPU, so a GPU lease never finds their defects: e2e_throughput.py's directly
written NVFP4 checkpoint (what inspect and the loaders read), its tables and row merging, and serve_bench.py's
client arguments (parsed by vLLM's own ``vllm bench serve`` parser), its partial-run refusal, its table and its
workloads (the default and prefill-heavy, each in its own report)."""

from __future__ import annotations

import json
import math
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_throughput as e2e  # noqa: E402
import serve_bench  # noqa: E402

from moe_nvfp4.convert import inspect_checkpoint  # noqa: E402
from moe_nvfp4.formats import NVFP4Tensor, dequantize_nvfp4  # noqa: E402
from moe_nvfp4.zoo import zoo_shape  # noqa: E402

ENV = {
    "device": "cpu",
    "torch": "2",
    "cuda": None,
    "vllm": "0.26.0",
    "triton": "3.6.0",
    "moe_nvfp4": "0",
    "git_commit": "abc",
    "date": "2026-11-27",
}


@pytest.fixture
def small_vocab(monkeypatch):
    """The models' layer shapes as they are, a 512-word vocabulary (the embeddings are what makes a layer big)."""
    monkeypatch.setattr(e2e, "MODELS", {k: {**v, "vocab": 512} for k, v in e2e.MODELS.items()})


def test_directly_written_checkpoint_is_clean_and_has_the_weights_rms(tmp_path, small_vocab):
    """Qwen3-30B-A3B's real expert shapes at one layer: inspect finds nothing wrong, every expert tensor is there
    with the shape the config gives, and the dequantized weights have about WEIGHT_RMS (the random model's
    activations stay in a trained model's range); a second call reuses the directory."""
    out = e2e.write_nvfp4_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", 1)
    report = inspect_checkpoint(out)
    assert report.ok and not report.problems, str(report)
    moe = zoo_shape("qwen3-30b-a3b")
    assert report.experts_per_layer == {"model.layers.0.mlp.experts": moe.experts}
    assert report.shapes == {
        "gate": (moe.intermediate, moe.hidden),
        "up": (moe.intermediate, moe.hidden),
        "down": (moe.hidden, moe.intermediate),
    }
    cfg = json.loads((out / "config.json").read_text())
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))  # transformers 5 renamed Qwen3-MoE's key
    assert (cfg["num_hidden_layers"], experts, cfg["moe_intermediate_size"]) == (1, moe.experts, moe.intermediate)
    assert report.quant_algo == "W4A16_NVFP4" and report.metadata["gate_up_global_scale"] == "separate"
    tensors = load_file(str(out / "model-00001-of-00002.safetensors"))
    p = "model.layers.0.mlp.experts.5.up_proj"
    up = NVFP4Tensor(
        tensors[f"{p}.weight"][None], tensors[f"{p}.weight_scale"][None], tensors[f"{p}.weight_scale_2"].reshape(1)
    )
    rms = float(dequantize_nvfp4(up).pow(2).mean().sqrt())  # ModelOpt's weight_scale_2 multiplies, as ours
    assert 0.8 * e2e.WEIGHT_RMS < rms < 1.25 * e2e.WEIGHT_RMS, rms
    mtime = (out / "config.json").stat().st_mtime_ns
    assert e2e.write_nvfp4_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", 1) == out
    assert (out / "config.json").stat().st_mtime_ns == mtime and not (tmp_path / "ckpt.partial").exists()


@pytest.fixture
def no_checkpoints(tmp_path, monkeypatch):
    """e2e_throughput's checkpoints and environment stood in for: the tests below run no engine."""
    monkeypatch.setattr(e2e, "checkpoints", lambda *a, **k: {"bf16": tmp_path / "bf16", "modelopt": tmp_path / "fp4"})
    monkeypatch.setattr(e2e, "environment", lambda: ENV)


START_S = {"nvfp4_grouped": 161.2, "modelopt_fp4": 62.0, None: 59.9}  # engine start by quantization


def _fake_runner(rows_for: dict, returncode: int = 0):
    """run_runner's stand-in: writes the rows the engine would for the spec's quantization, or fails."""

    def run(runner: str, spec: dict):
        if returncode == 0:
            rows = rows_for[spec["quantization"]]
            ran = rows if runner == e2e.LOAD_RUNNER else {"engine_start_s": START_S[spec["quantization"]], "rows": rows}
            Path(spec["out"]).write_text(json.dumps(ran))
        log = (
            "INFO nvfp4_grouped: compiled MoE kernels in 9.0 s\nINFO other line\n"
            if spec["quantization"] == "nvfp4_grouped"
            else ""
        )
        return Namespace(returncode=returncode, stdout=log, stderr="Traceback: engine died")

    return run


@pytest.mark.usefixtures("no_checkpoints")
def test_throughput_rows_merge_per_path_and_a_failed_path_fails_the_run(tmp_path, monkeypatch):
    """One path per call builds one table; a rerun replaces that path's rows; a failed path is shown failed, keeps
    no stale rows and makes the exit status 1."""
    speed = {"nvfp4_grouped": 300.0, "modelopt_fp4": 200.0, None: 100.0}
    rows = {q: [{"batch": b, "seconds": 1.0, "output_tokens_per_s": v * b} for b in (1, 16)] for q, v in speed.items()}
    monkeypatch.setattr(e2e, "run_runner", _fake_runner(rows))
    common = ["--batches", "1", "16", "--out", str(tmp_path / "out"), "--layers", "2"]
    for path in ("ours", "vllm_modelopt_fp4", "bf16"):
        assert e2e.main(["--paths", path, *common]) == 0
    report = json.loads((tmp_path / "out" / "e2e_qwen3-30b-a3b_L2.json").read_text())
    assert [r["path"] for r in report["results"]] == ["ours", "vllm_modelopt_fp4", "bf16"]
    assert [r["plugin_log"] for r in report["results"]] == [
        ["INFO nvfp4_grouped: compiled MoE kernels in 9.0 s"],
        [],
        [],
    ]
    table = (tmp_path / "out" / "e2e_qwen3-30b-a3b_L2.md").read_text()
    assert "| 16 | 4800 | 3200 | 1600 | 1.50x | 3.00x |" in table, table
    assert "Engine start (`LLM(...)` until it returns): ours 161 s, vllm_modelopt_fp4 62 s, bf16 60 s." in table, table
    monkeypatch.setattr(e2e, "run_runner", _fake_runner(rows, returncode=1))
    assert e2e.main(["--paths", "ours", *common]) == 1
    report = json.loads((tmp_path / "out" / "e2e_qwen3-30b-a3b_L2.json").read_text())
    ours = [r for r in report["results"] if r["path"] == "ours"]
    assert len(ours) == 1 and "rows" not in ours[0] and "engine died" in ours[0]["error"]
    table = (tmp_path / "out" / "e2e_qwen3-30b-a3b_L2.md").read_text()
    assert "| 16 | failed | 3200 | 1600 | - | - |" in table and "`ours` failed" in table, table


# A stand-in ``vllm`` for the runner script itself: an engine that logs as vLLM's does (to stdout) and returns
# exactly the tokens asked for.
FAKE_VLLM = """
import time
class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens
class _Out:
    def __init__(self, n):
        self.outputs = [type("Completion", (), {"token_ids": list(range(n))})()]
class LLM:
    def __init__(self, **kw):
        print("INFO nvfp4_grouped: compiled MoE kernels for token counts [1] (up to 8) in 0.0 s", flush=True)
        print("INFO [default_loader.py:291] Loading weights took 0.98 seconds", flush=True)
        print("INFO [monitor.py:53] torch.compile took 27.45 s in total", flush=True)
        print("INFO some other line", flush=True)
    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(0.01)
        return [_Out(params.max_tokens) for _ in prompts]
"""


def test_the_throughput_runner_script_writes_what_run_path_reads(tmp_path, monkeypatch):
    """RUNNER (the script each path's subprocess runs) with a stand-in vLLM: run_path gets every batch's rows, the
    engine start, the plugin's log line and vLLM's start-phase lines, through the real subprocess and files."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = Namespace(
        model="qwen3-30b-a3b", batches=[1, 3], input_len=4, output_len=5, repeats=2, gpu_memory_utilization=0.5
    )
    result = e2e.run_path("bf16", tmp_path / "ckpt", None, args, tmp_path)
    assert "error" not in result, result.get("error")
    assert [(r["batch"], len(r["seconds_all"])) for r in result["rows"]] == [(1, 2), (3, 2)]
    assert all(r["output_tokens_per_s"] > 0 for r in result["rows"]) and result["engine_start_s"] >= 0
    assert result["plugin_log"] == ["INFO nvfp4_grouped: compiled MoE kernels for token counts [1] (up to 8) in 0.0 s"]
    assert result["start_log"] == [
        "INFO [default_loader.py:291] Loading weights took 0.98 seconds",
        "INFO [monitor.py:53] torch.compile took 27.45 s in total",
    ]


@pytest.mark.usefixtures("no_checkpoints")
def test_load_memory_report_counts_experts_and_sets_the_first_moe_layer_apart(tmp_path, monkeypatch):
    """Peaks per layer as the runner records them: the first MoE layer (autotune, compile) apart, the other MoE
    layers' maximum in units of one expert's NVFP4 bytes; a path whose engine failed is shown failed."""
    one = e2e.expert_bytes("qwen3-30b-a3b", None)
    moe = zoo_shape("qwen3-30b-a3b")
    assert one == 3 * (moe.intermediate * moe.hidden * 9 // 16 + 4)
    layer = [
        {"module": "RoutedExperts", "before": 0, "peak_extra": p, "kept_extra": 0} for p in (50 * one, one // 2, one)
    ]
    rows = {"nvfp4_grouped": [{"module": "QKVParallelLinear", "before": 0, "peak_extra": 3, "kept_extra": 0}, *layer]}
    monkeypatch.setattr(e2e, "run_runner", _fake_runner(rows))
    out = tmp_path / "out"
    assert e2e.main(["--load-memory", "--paths", "ours", "bf16", "--out", str(out)]) == 0
    report = json.loads((out / "e2e_load_memory_qwen3-30b-a3b_L48.json").read_text())
    (r,) = report["load_memory"]  # bf16 repacks nothing: not measured
    assert (r["first_moe_peak_extra"], r["other_moe_peak_extra_max"], r["any_layer_peak_extra_max"]) == (
        50 * one,
        one,
        50 * one,
    )
    table = (out / "e2e_load_memory_qwen3-30b-a3b_L48.md").read_text()
    assert "(50.0 experts) |" in table and "(1.0 experts) |" in table, table
    monkeypatch.setattr(e2e, "run_runner", _fake_runner(rows, returncode=1))
    assert e2e.main(["--load-memory", "--paths", "ours", "--out", str(out)]) == 1
    assert "| ours | failed | | |" in (out / "e2e_load_memory_qwen3-30b-a3b_L48.md").read_text()


def _serve_args(**kw) -> Namespace:
    return Namespace(model="qwen3-30b-a3b", input_len=512, output_len=256, num_prompts=256, **kw)


def test_bench_arguments_parse_with_vllms_own_client():
    """What bench_once passes to ``vllm bench serve`` means what it says to vLLM's parser (an option renamed in a
    vLLM release fails here, not in a lease)."""
    client = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    client.add_cli_args(parser)
    result = Path("/tmp/out/serve_qwen3_ours_rateinf.json")
    for rate in (math.inf, 4.0):
        a = parser.parse_args(serve_bench.bench_arguments(8123, "ours", Path("/ck"), rate, _serve_args(), result))
        assert (a.backend, a.host, a.port, a.model, a.tokenizer) == ("vllm", "127.0.0.1", 8123, "ours", "/ck")
        assert (a.dataset_name, a.random_input_len, a.random_output_len, a.num_prompts) == ("random", 512, 256, 256)
        assert a.request_rate == rate and a.ignore_eos and a.save_result and a.disable_tqdm
        assert (a.result_dir, a.result_filename) == ("/tmp/out", result.name)
        assert (a.percentile_metrics, a.metric_percentiles) == ("ttft,tpot,itl", "50,99")


@pytest.mark.parametrize(("completed", "failed"), [(256, 0), (250, 6)])
def test_bench_once_keeps_the_metrics_and_refuses_a_partial_run(tmp_path, monkeypatch, completed, failed):
    """A run where requests failed is marked an error: its timings are over part of the load, not this rate's."""
    raw = {
        "completed": completed,
        "failed": failed,
        "output_throughput": 5000.0,
        "median_ttft_ms": 30.0,
        "p99_ttft_ms": 90.0,
        "median_tpot_ms": 8.0,
        "p99_tpot_ms": 9.5,
    }

    def client(cmd, **kw):
        (tmp_path / cmd[cmd.index("--result-filename") + 1]).write_text(json.dumps(raw))
        return Namespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(serve_bench.subprocess, "run", client)
    row = serve_bench.bench_once(8123, "ours", tmp_path, 16.0, _serve_args(), tmp_path)
    assert {k: row[k] for k in serve_bench.METRICS} == {k: raw[k] for k in serve_bench.METRICS}
    assert ("error" in row) == (completed != 256), row


def test_serving_table_keeps_earlier_paths_and_sets_ours_against_each(tmp_path, monkeypatch):
    """One path per call builds one table; tok/s and TPOT ratios are ours over the row's path; a failed rate
    shows failed and makes the exit status 1."""
    monkeypatch.setattr(serve_bench, "checkpoints", lambda *a, **k: {"bf16": tmp_path, "modelopt": tmp_path})
    monkeypatch.setattr(serve_bench, "write_word_tokenizer", lambda *a: None)
    monkeypatch.setattr(serve_bench, "environment", lambda: ENV)
    metrics = {"ours": (6000.0, 5.0), "vllm_modelopt_fp4": (4000.0, 8.0)}

    def run_path(name, ckpt, args, out_dir):
        tok, tpot = metrics[name]
        rows = [
            {
                "rate": r,
                "output_throughput": tok,
                "median_ttft_ms": 20.0,
                "p99_ttft_ms": 40.0,
                "median_tpot_ms": tpot,
                "p99_tpot_ms": tpot * 1.5,
            }
            for r in args.rates
        ]
        if name == "vllm_modelopt_fp4":
            rows[-1] = {"rate": args.rates[-1], "error": "250 of 256 requests completed (6 failed)"}
        return {"path": name, "rows": rows}

    monkeypatch.setattr(serve_bench, "run_path", run_path)
    common = ["--layers", "2", "--out", str(tmp_path / "out"), "--rates", "inf", "4"]
    assert serve_bench.main(["--paths", "ours", *common]) == 0
    assert serve_bench.main(["--paths", "vllm_modelopt_fp4", *common]) == 1
    report = json.loads((tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").read_text())
    assert list(report["results"]) == ["ours", "vllm_modelopt_fp4"]
    table = (tmp_path / "out" / "serve_qwen3-30b-a3b_L2.md").read_text()
    assert "| inf | vllm_modelopt_fp4 | 4000 | 20.0 / 40.0 | 8.00 / 12.00 | 1.50x | 0.62x |" in table, table
    assert "| 4.0 | vllm_modelopt_fp4 | failed | | | | |" in table, table


def _fake_serving(monkeypatch, tmp_path, seen):
    monkeypatch.setattr(serve_bench, "checkpoints", lambda *a, **k: {"bf16": tmp_path, "modelopt": tmp_path})
    monkeypatch.setattr(serve_bench, "write_word_tokenizer", lambda *a: None)
    monkeypatch.setattr(serve_bench, "environment", lambda: ENV)

    def run_path(name, ckpt, args, out_dir):
        seen.append((name, args.input_len, args.output_len, args.workload))
        return {
            "path": name,
            "rows": [
                {
                    "rate": r,
                    "output_throughput": 100.0,
                    "median_ttft_ms": 20.0,
                    "p99_ttft_ms": 40.0,
                    "median_tpot_ms": 5.0,
                    "p99_tpot_ms": 6.0,
                }
                for r in args.rates
            ],
        }

    monkeypatch.setattr(serve_bench, "run_path", run_path)


def test_the_prefill_heavy_workload_is_2048_in_128_out_in_its_own_report(tmp_path, monkeypatch):
    """--workload prefill-heavy sends 2048-token prompts for 128 tokens each and writes its own report (the default
    workload's table stays as it was); the lengths can still be given; the Markdown says the workload."""
    assert (serve_bench.parse_args([]).input_len, serve_bench.parse_args([]).output_len) == (512, 256)
    heavy = serve_bench.parse_args(["--workload", "prefill-heavy"])
    assert (heavy.workload, heavy.input_len, heavy.output_len) == ("prefill-heavy", 2048, 128)
    assert serve_bench.parse_args(["--workload", "prefill-heavy", "--input-len", "4096"]).input_len == 4096
    seen: list = []
    _fake_serving(monkeypatch, tmp_path, seen)
    common = ["--layers", "2", "--out", str(tmp_path / "out"), "--rates", "inf"]
    assert serve_bench.main(["--paths", "ours", *common]) == 0
    assert serve_bench.main(["--paths", "ours", "humming", "--workload", "prefill-heavy", *common]) == 0
    assert seen == [
        ("ours", 512, 256, "default"),
        ("ours", 2048, 128, "prefill-heavy"),
        ("humming", 2048, 128, "prefill-heavy"),
    ]
    report = json.loads((tmp_path / "out" / "serve_qwen3-30b-a3b_L2_prefill-heavy.json").read_text())
    assert list(report["results"]) == ["ours", "humming"] and report["args"]["workload"] == "prefill-heavy"
    assert list(json.loads((tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").read_text())["results"]) == ["ours"]
    table = (tmp_path / "out" / "serve_qwen3-30b-a3b_L2_prefill-heavy.md").read_text()
    assert "workload prefill-heavy: 256 prompts of 2048 tokens, 128 output tokens (ignore_eos)" in table, table


def test_a_report_of_another_workload_is_never_merged_into(tmp_path, monkeypatch, capsys):
    """Rows of other lengths in the same file are no comparison: the call is refused (exit 2) and the file kept."""
    seen: list = []
    _fake_serving(monkeypatch, tmp_path, seen)
    common = ["--layers", "2", "--out", str(tmp_path / "out"), "--rates", "inf"]
    assert serve_bench.main(["--paths", "ours", *common]) == 0
    before = (tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").read_text()
    assert serve_bench.main(["--paths", "bf16", "--input-len", "1024", *common]) == 2
    assert "holds runs with another workload (input_len=512)" in capsys.readouterr().err
    assert (tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").read_text() == before and len(seen) == 1
    old = json.loads(before)  # a report from before --workload: its runs were the default workload
    del old["args"]["workload"]
    (tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").write_text(json.dumps(old))
    assert serve_bench.main(["--paths", "bf16", *common]) == 0
    assert list(json.loads((tmp_path / "out" / "serve_qwen3-30b-a3b_L2.json").read_text())["results"]) == [
        "ours",
        "bf16",
    ]


def test_serving_w4a8_path_starts_ours_with_the_mode_switched_on(tmp_path, monkeypatch):
    """ours_w4a8 serves the same checkpoint with the same arguments as ours, and MOE_NVFP4_FP8_ACTIVATIONS=1 in the
    server's environment (ours without it); both keep the multicast-off settings."""
    started = {}

    class Server:
        def __init__(self, serve_args, *, port, log_path, env):
            self.key = next(a for a in serve_args if a in ("ours", "ours_w4a8"))
            started[self.key] = (serve_args, env)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def start(self, timeout_s):
            return 1.0

        def stop(self, timeout_s):
            return 0.5

    monkeypatch.setattr(serve_bench, "VllmServer", Server)
    monkeypatch.setattr(serve_bench, "bench_once", lambda port, name, tok, rate, args, out: {"rate": rate})
    monkeypatch.delenv("MOE_NVFP4_FP8_ACTIVATIONS", raising=False)
    args = serve_bench.parse_args(["--rates", "inf"])
    for name in ("ours", "ours_w4a8"):
        serve_bench.run_path(name, tmp_path, args, tmp_path)
    (ours_args, ours_env), (w4a8_args, w4a8_env) = started["ours"], started["ours_w4a8"]
    assert [a for a in ours_args if a != "ours"] == [a for a in w4a8_args if a != "ours_w4a8"]
    assert w4a8_env["MOE_NVFP4_FP8_ACTIVATIONS"] == "1" and "MOE_NVFP4_FP8_ACTIVATIONS" not in ours_env
    assert w4a8_env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == ours_env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm"
