"""Run an engine subprocess until it has written its results file (tests/gpu/test_vllm_e2e.py).

The runner writes its results whole (write, then rename) once generation is done.  An engine that then
fails to shut down (vLLM 0.26.0 at TP=2 without NVLink multicast can hang in a symmetric-memory destructor)
gets ``exit_grace_s`` and is killed with a warning: the results are what the tests check.  The engine runs
in its own session, and its whole process group is killed on every way out, so no worker keeps the GPUs.

``MOE_NVFP4_ENGINE_LOGS=<dir>`` also writes each engine's stderr to ``<dir>/<tag>.log`` line by line, so it
survives a run that is killed from outside (a device call's time limit) before pytest reports anything.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest


def run_until_written(
    cmd: list[str], env: dict[str, str], out: Path, *, tag: str, timeout_s: float, exit_grace_s: float
) -> None:
    """Start ``cmd``; return once ``out`` exists and the process has exited or was killed ``exit_grace_s``
    later; ``pytest.fail`` with the stderr tail if ``out`` never appears (exit or ``timeout_s``)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    stderr: list[str] = []  # read by a thread so a chatty engine cannot block on a full pipe
    log_dir = os.environ.get("MOE_NVFP4_ENGINE_LOGS")

    def read() -> None:
        if not log_dir:
            stderr.extend(proc.stderr)
            return
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / f"{tag}.log", "w", buffering=1) as log:  # line-buffered: kept if we are killed
            for line in proc.stderr:
                stderr.append(line)
                log.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.wait(timeout=exit_grace_s if out.exists() else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if out.exists():
            warnings.warn(f"{tag}: wrote its results but did not exit within {exit_grace_s} s; killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    if not out.exists():
        pytest.fail(f"{tag}: no results (rc {proc.returncode}, limit {timeout_s} s):\n{''.join(stderr)[-6000:]}")
    if proc.returncode not in (0, -signal.SIGKILL):
        warnings.warn(f"{tag}: wrote its results, then exited with rc {proc.returncode}")
