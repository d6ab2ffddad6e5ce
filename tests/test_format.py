"""The code is formatted by the configured formatter (pyproject's [tool.ruff]: ruff format, 120 columns), so a
change's diff is its content, not its layout (issue 56).  `ruff format .` fixes what this finds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_ruff_formatted() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' brings it (the test extra pins it)")
    proc = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, "run `ruff format .`:\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
