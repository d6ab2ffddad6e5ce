"""The code is formatted by the configured formatter (pyproject's [tool.ruff]: ruff format, 120 columns), so a
change's diff is its content, not its layout (issue 56).  `ruff format .` fixes what this finds.  And host
functions stay under 80 lines, package files outside kernel modules under 500."""

from __future__ import annotations

import ast
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
MAX_FILE_LINES = 500
PACKAGES = ("moe_nvfp4", "integrations")


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(word in ast.unparse(d) for d in node.decorator_list for word in KERNEL_DECORATORS)


def _parsed() -> list[tuple[Path, str, ast.Module]]:
    """Every package file: path, text, syntax tree."""
    found = []
    for root in PACKAGES:
        for path in sorted((ROOT / root).rglob("*.py")):
            text = path.read_text()
            found.append((path, text, ast.parse(text)))
    return found


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_over_80_lines_outside_kernels() -> None:
    """Host code stays in functions one screen long (issue 56): a longer one does several jobs, so name them."""
    long = []
    for path, _, tree in _parsed():
        for node in _functions(tree):
            lines = node.end_lineno - node.lineno + 1
            if not _is_kernel(node) and lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these:\n" + "\n".join(long)


def test_no_file_over_500_lines_outside_kernel_modules() -> None:
    """A module does one job and reads in one sitting (issue 56): past 500 lines, split it by job into modules whose
    names say what they hold (api.py and bench/paths.py were 586 and 550).  A kernel module (one that defines a
    @triton.jit / @gluon.jit / @cute.kernel function) is exempt: its kernel reads as one piece."""
    long = []
    for path, text, tree in _parsed():
        lines = text.count("\n")
        if lines > MAX_FILE_LINES and not any(_is_kernel(node) for node in _functions(tree)):
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not long, "split these by job:\n" + "\n".join(long)


def test_the_size_checks_see_what_they_should() -> None:
    """The two checks above cannot pass by reading nothing: they see the package, the kernels they exempt, and
    a host function's length."""
    files = {path.relative_to(ROOT).as_posix(): tree for path, _, tree in _parsed()}
    assert "moe_nvfp4/api.py" in files and "integrations/moe_nvfp4_vllm/moe_method.py" in files
    gluon = _functions(files["moe_nvfp4/sm90/gemm_gluon.py"])
    assert any(_is_kernel(f) for f in gluon) and not all(_is_kernel(f) for f in gluon)
    fused_moe = next(f for f in _functions(files["moe_nvfp4/api.py"]) if f.name == "fused_moe")
    assert not _is_kernel(fused_moe) and 20 < fused_moe.end_lineno - fused_moe.lineno + 1 <= MAX_FUNCTION_LINES
