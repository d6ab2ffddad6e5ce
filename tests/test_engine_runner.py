"""tests/helpers_engine.py: results taken as soon as written, hung or failed engines handled (CPU)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers_engine import process_stat, run_until_written  # noqa: E402

# What cuda-gdb 13 printed for a TP=2 worker stuck in vLLM's KV-cache write (H100, 2026-11-25), trimmed.
STUCK_ROW = (
    "*      0      -   1 31314 Active 0x03f0000000000000000000000000000000 (8,1,1) (16,1,1) "
    "vllm::reshape_and_cache_flash_kernel()"
)
CUDA_GDB_STUCK = f"""Thread 1 "VLLM::Worker_TP" stopped.
0x0000002bdd8c3d20 in void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(...)<<<(8,1,1),(16,1,1)>>> ()
  Kernel Parent Dev Grid Status                             SMs Mask GridDim BlockDim Invocation
{STUCK_ROW}
  Dev PCI Bus/Dev ID                  Name Description SM Type SMs Warps/SM Lanes/Warp Max Regs/Lane
*   1        00:07.0 NVIDIA H100 80GB HBM3   GH100GL-A   sm_90 132       64         32           255
"""


@pytest.fixture
def fake_cuda_gdb(tmp_path: Path, monkeypatch) -> Path:
    """A `cuda-gdb` first on PATH that prints CUDA_GDB_STUCK and records the pid it was asked about."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "attached"
    bin_dir.mkdir()
    gdb = bin_dir / "cuda-gdb"
    gdb.write_text(f"#!/bin/sh\necho \"$2\" >> {seen}\ncat <<'EOF'\n{CUDA_GDB_STUCK}EOF\n")
    gdb.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return seen


def _alive(pid: int) -> bool:
    """Running (a killed child waiting to be reaped by init shows as a zombie, state Z)."""
    fields = process_stat(pid)
    return fields is not None and fields[0] != "Z"


def _dies(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone within ``within_s``: SIGKILL to a process group returns before its processes are
    dead (CI once saw the worker still running right after the runner returned)."""
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _write(out: Path) -> str:
    return f"import os; open({str(out)!r} + '.tmp', 'w').write('[]'); os.replace({str(out)!r} + '.tmp', {str(out)!r})"


def test_clean_exit(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run_until_written(_python(_write(out)), dict(os.environ), out, tag="clean", timeout_s=30, exit_grace_s=5)
    assert out.read_text() == "[]"


def test_hang_after_writing_is_killed_with_a_warning(tmp_path: Path) -> None:
    out, pid_file = tmp_path / "r.json", tmp_path / "child.pid"
    # the engine forks a worker (same process group) and then never exits
    code = (
        f"import os, time, subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); {_write(out)}; time.sleep(600)"
    )
    start = time.monotonic()
    with pytest.warns(UserWarning, match="did not exit within 1 s"):
        run_until_written(_python(code), dict(os.environ), out, tag="hang", timeout_s=60, exit_grace_s=1)
    assert time.monotonic() - start < 30
    assert _dies(int(pid_file.read_text()))  # the worker died with its engine's process group


def test_failure_without_results_reports_stderr(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(pytest.fail.Exception, match="(?s)rc 3.*engine exploded"):
        run_until_written(
            _python("import sys; sys.stderr.write('engine exploded'); sys.exit(3)"),
            dict(os.environ),
            out,
            tag="fail",
            timeout_s=30,
            exit_grace_s=5,
        )


def test_hang_without_results_times_out(tmp_path: Path, fake_cuda_gdb: Path) -> None:
    out = tmp_path / "r.json"
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="no results"):
        run_until_written(
            _python("import time; time.sleep(600)"), dict(os.environ), out, tag="stuck", timeout_s=2, exit_grace_s=5
        )
    assert time.monotonic() - start < 20


def test_hang_without_results_names_the_resident_kernels(tmp_path: Path, fake_cuda_gdb: Path) -> None:
    """Every live process of the engine's group (here the engine and its worker) is asked; only kernel rows
    of cuda-gdb's answer reach the failure, each under its pid."""
    out, pid_file = tmp_path / "r.json", tmp_path / "child.pid"
    code = (
        f"import time, subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)"
    )
    with pytest.raises(pytest.fail.Exception) as failure:
        run_until_written(_python(code), dict(os.environ), out, tag="stuck", timeout_s=3, exit_grace_s=5)
    message = str(failure.value)
    worker = int(pid_file.read_text())
    attached = [int(p) for p in fake_cuda_gdb.read_text().split()]
    assert worker in attached and len(attached) == 2
    assert f"pid {worker}: {STUCK_ROW}" in message
    assert message.count(STUCK_ROW) == 2  # one kernel row per process, nothing else
    assert "NVIDIA H100" not in message and "Thread 1" not in message
    assert _dies(worker)


def test_kernel_report_without_cuda_gdb(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cuda-gdb anywhere
    out = tmp_path / "r.json"
    with pytest.raises(pytest.fail.Exception, match="resident CUDA kernels at the time limit:\ncuda-gdb not installed"):
        run_until_written(
            _python("import time; time.sleep(600)"), dict(os.environ), out, tag="stuck", timeout_s=2, exit_grace_s=5
        )


def test_engine_log_written_line_by_line(tmp_path: Path, monkeypatch) -> None:
    """MOE_NVFP4_ENGINE_LOGS: the engine's stderr also lands in <dir>/<tag>.log (an engine that never finishes)."""
    logs, out = tmp_path / "logs", tmp_path / "r.json"
    monkeypatch.setenv("MOE_NVFP4_ENGINE_LOGS", str(logs))
    code = "import sys, time; sys.stderr.write('loading\\n'); sys.stderr.flush(); time.sleep(600)"
    with pytest.raises(pytest.fail.Exception, match="loading"):
        run_until_written(_python(code), dict(os.environ), out, tag="slow", timeout_s=3, exit_grace_s=5)
    assert (logs / "slow.log").read_text() == "loading\n"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tiny_models_give_each_rank_a_warp_of_kv_cache_threads(family: str, tp: int) -> None:
    """The engine tests' models never reach vLLM 0.26.0's endless KV-cache write (under 32 threads a token)."""
    from helpers_checkpoints import kv_cache_threads_per_rank, tiny_config

    assert kv_cache_threads_per_rank(tiny_config(family), tp) >= 32


def test_kv_cache_threads_of_the_model_that_hung() -> None:
    """Head dim 16 with 2 KV heads: 32 threads at TP=1 (ran), 16 at TP=2 (hung), 16 at TP=4 (heads replicated)."""
    from helpers_checkpoints import kv_cache_threads_per_rank, tiny_config

    old = tiny_config("qwen3_moe")
    old.head_dim = 16
    assert [kv_cache_threads_per_rank(old, tp) for tp in (1, 2, 4)] == [32, 16, 16]
