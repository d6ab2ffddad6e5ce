"""tests/helpers_engine.py: results taken as soon as written, hung or failed engines handled (CPU)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers_engine import run_until_written  # noqa: E402


def _alive(pid: int) -> bool:
    """Running (a killed child waiting to be reaped by init shows as a zombie, state Z)."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


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
    code = (f"import os, time, subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); {_write(out)}; time.sleep(600)")
    start = time.monotonic()
    with pytest.warns(UserWarning, match="did not exit within 1 s"):
        run_until_written(_python(code), dict(os.environ), out, tag="hang", timeout_s=60, exit_grace_s=1)
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    assert not _alive(int(pid_file.read_text()))  # the worker died with its engine's process group


def test_failure_without_results_reports_stderr(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(pytest.fail.Exception, match="(?s)rc 3.*engine exploded"):
        run_until_written(_python("import sys; sys.stderr.write('engine exploded'); sys.exit(3)"), dict(os.environ), out,
                          tag="fail", timeout_s=30, exit_grace_s=5)  # fmt: skip


def test_hang_without_results_times_out(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="no results"):
        run_until_written(_python("import time; time.sleep(600)"), dict(os.environ), out, tag="stuck", timeout_s=2,
                          exit_grace_s=5)  # fmt: skip
    assert time.monotonic() - start < 20


def test_engine_log_written_line_by_line(tmp_path: Path, monkeypatch) -> None:
    """MOE_NVFP4_ENGINE_LOGS: the engine's stderr also lands in <dir>/<tag>.log (an engine that never finishes)."""
    logs, out = tmp_path / "logs", tmp_path / "r.json"
    monkeypatch.setenv("MOE_NVFP4_ENGINE_LOGS", str(logs))
    code = "import sys, time; sys.stderr.write('loading\\n'); sys.stderr.flush(); time.sleep(600)"
    with pytest.raises(pytest.fail.Exception, match="loading"):
        run_until_written(_python(code), dict(os.environ), out, tag="slow", timeout_s=3, exit_grace_s=5)
    assert (logs / "slow.log").read_text() == "loading\n"

