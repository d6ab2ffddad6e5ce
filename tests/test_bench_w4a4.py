"""benchmarks/bench_w4a4.py: sizes, bytes, and a host-clock smoke run of the whole script under the Triton
interpreter on shrunken shapes (the GPU run is the benchmark itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_w4a4 import PROBLEMS, problem_bytes, shrink  # noqa: E402


def test_problems_are_the_four_benchmark_shapes() -> None:
    assert [(len(ms), sum(ms), n, k) for ms, n, k in PROBLEMS] == [
        (8, 1024, 4096, 7168),
        (8, 1024, 7168, 2048),
        (2, 512, 3072, 4096),
        (2, 512, 4096, 1536),
    ]


def test_bytes_count_both_operands_scales_and_output() -> None:
    # A 1x32: 16 values bytes + 2 scale bytes + 4 global; B 2x32: 32 + 4 + 4; out 1x2 fp16: 4
    assert problem_bytes([1], 2, 32) == (16 + 2 + 4) + (32 + 4 + 4) + 4


def test_shrink_keeps_valid_sizes() -> None:
    for problem in PROBLEMS:
        ms, n, k = shrink(problem, 64)
        assert all(mm >= 1 for mm in ms) and n % 16 == 0 and k % 16 == 0 and n >= 16 and k >= 16


@pytest.mark.slow
def test_script_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [
        sys.executable,
        str(BENCH / "bench_w4a4.py"),
        "--device",
        "cpu",
        "--shrink",
        "64",
        "--problems",
        "3",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "w4a4.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["problem"] == 3 and rows[0]["rel_err"] < 2e-3
    assert rows[0]["us"] > 0 and rows[0]["hbm_floor_us"] > 0 and rows[0]["timing"]["method"] == "eager"
    assert "W4A4 NVFP4 grouped GEMM" in (tmp_path / "w4a4.md").read_text()
