"""GPU tier of `moe-nvfp4 demo` and `moe-nvfp4 bench` (run with ``pytest -m gpu`` on an sm_90 machine): the
commands a user runs first, run as the user would, on Qwen3-30B-A3B's layer.

Bound (REL_TOL), ||out - ref|| / ||ref|| of the fused kernel against the float32 torch reference on the same
dequantized NVFP4 weights: the bench's own (bf16 rounding of x, of the SiLU*up intermediate and of the output).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from moe_nvfp4.cli import main

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True)
def _sm90():
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the demo and the bench refuse GPUs other than sm_90 (tests/test_demo.py checks the refusal)")


def test_demo_runs_the_kernel_checks_it_and_times_it(capsys):
    assert main(["demo", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    print(out)  # the lead's closing note quotes it
    assert "(sm_90): the fused kernel on Qwen3-30B-A3B's MoE layer, E=128 top-8 H=2048 I=768, T=16" in out, out
    err = float(re.search(r"\|\|out-ref\|\|/\|\|ref\|\| = ([0-9.e+-]+) \(ok", out).group(1))
    assert 0 < err < REL_TOL
    times = dict(re.findall(r"^\| (.+?) +\| +([0-9.]+) \|", out, re.M))
    labels = ["ours: fused NVFP4 kernel (W4A16)", "torch BF16 (per-expert loop)"]
    labels += ["vLLM Triton BF16 (fused_experts)", "vLLM Marlin NVFP4"] if HAS_VLLM else []
    for label in labels:
        assert float(times[label]) > 0, (label, out)
    floor = next(float(v) for k, v in times.items() if k.startswith("HBM floor"))
    assert 0 < floor < float(times["ours: fused NVFP4 kernel (W4A16)"])
    assert float(times["ours: fused NVFP4 kernel (W4A16)"]) < float(times["torch BF16 (per-expert loop)"])


def test_bench_short_run_writes_sane_rows(tmp_path, capsys):
    paths = ["ours", "torch"] + (["marlin", "bf16"] if HAS_VLLM else [])
    out_json = tmp_path / "qwen3.json"
    argv = [
        "bench",
        "--model",
        "qwen3-30b-a3b",
        "--tokens",
        "1,16",
        "--quick",
        "--paths",
        ",".join(paths),
        "--out",
        str(out_json),
    ]
    assert main(argv) == 0
    print(capsys.readouterr().out)
    data = json.loads(out_json.read_text())
    assert data["meta"]["capability"] == "9.0" and data["meta"]["ceilings"]["copy_GBps"] > 1000
    rows = data["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [("Qwen3-30B-A3B", 1), ("Qwen3-30B-A3B", 16)]
    for r in rows:
        assert 0 < r["rel_err_ours_vs_ref"] < REL_TOL, r
        assert r["ours_timing"]["method"] == "graph", r
        for name in paths:
            assert r[f"{name}_us"] > 0, (name, r)
        assert 0 < r["hbm_floor_us"] <= r["floor_us"] < r["ours_us"]
        assert "MISMATCH" not in r["status"], r["status"]
