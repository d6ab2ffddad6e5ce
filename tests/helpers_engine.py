"""Run an engine subprocess until it has written its results file (tests/gpu/test_vllm_e2e.py).

The runner writes its results whole (write, then rename) once generation is done.  An engine that then
fails to shut down (vLLM 0.26.0 at TP=2 without NVLink multicast can hang in a symmetric-memory destructor)
gets ``exit_grace_s`` and is killed with a warning: the results are what the tests check.  The engine runs
in its own session, and its whole process group is killed on every way out, so no worker keeps the GPUs.

An engine that never writes its results is asked, before it is killed, which CUDA kernels are resident on
its GPUs (``cuda-gdb -p PID``, where cuda-gdb is installed): a GPU step that never finishes names its kernel
in the failure, which is how the TP=2 hang in vLLM's KV-cache write was found.

``MOE_NVFP4_ENGINE_LOGS=<dir>`` also writes each engine's stderr to ``<dir>/<tag>.log`` line by line, so it
survives a run that is killed from outside (a device call's time limit) before pytest reports anything.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest


KERNEL_ROW = re.compile(r"^\*?\s*\d+\s+\S+\s+\d+\s+\d+\s+\w+\s")  # `info cuda kernels`: Kernel Parent Dev Grid Status
MAX_ATTACHED = 4  # processes asked for their kernels (engine core and TP workers)


def process_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, pgrp, ...; None once the process is gone.  A killed
    child not yet reaped shows state Z."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = process_stat(int(entry.name))
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def resident_cuda_kernels(pgid: int, timeout_s: float = 45.0) -> str:
    """``info cuda kernels`` of each live process in the group, one line per resident kernel, or why not."""
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return "cuda-gdb not installed"
    report = []
    for pid in _group_pids(pgid)[:MAX_ATTACHED]:
        try:
            r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "info cuda kernels", "-ex", "detach"],
                               capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            report.append(f"pid {pid}: cuda-gdb timed out after {timeout_s} s")
            continue
        rows = [line.strip() for line in r.stdout.splitlines() if KERNEL_ROW.match(line.strip())]
        report.extend(f"pid {pid}: {row}" for row in rows)
    return "\n".join(report) or "no resident CUDA kernels"


def run_until_written(
    cmd: list[str], env: dict[str, str], out: Path, *, tag: str, timeout_s: float, exit_grace_s: float
) -> str:
    """Start ``cmd``; return its stderr once ``out`` exists and the process has exited or was killed
    ``exit_grace_s`` later; ``pytest.fail`` with the stderr tail if ``out`` never appears (exit or ``timeout_s``)."""
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
    kernels = ""
    try:
        while proc.poll() is None and not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.wait(timeout=exit_grace_s if out.exists() else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if out.exists():
            warnings.warn(f"{tag}: wrote its results but did not exit within {exit_grace_s} s; killed")
        else:
            kernels = f"\nresident CUDA kernels at the time limit:\n{resident_cuda_kernels(proc.pid)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    if not out.exists():
        pytest.fail(f"{tag}: no results (rc {proc.returncode}, limit {timeout_s} s):\n{''.join(stderr)[-6000:]}{kernels}")
    if proc.returncode not in (0, -signal.SIGKILL):
        warnings.warn(f"{tag}: wrote its results, then exited with rc {proc.returncode}")
    return "".join(stderr)
