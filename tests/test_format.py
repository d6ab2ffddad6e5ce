"""The code is formatted by the configured formatter (pyproject's [tool.ruff]: ruff format, 120 columns), so a
change's diff is its content, not its layout (issue 56).  `ruff format .` fixes what this finds.  And host
functions stay under 80 lines."""

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


KERNEL_DECORATORS = ("jit", "kernel")  # triton.jit, gluon.jit, cute.kernel, cute.jit: a kernel reads as one piece
MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines_outside_kernels() -> None:
    """Host code stays in functions one screen long (issue 56): a longer one does several jobs, so name them."""
    import ast

    long = []
    for root in ("moe_nvfp4", "integrations"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if any(word in ast.unparse(d) for d in node.decorator_list for word in KERNEL_DECORATORS):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these:\n" + "\n".join(long)
