"""The package's import graph (read with ``ast``, nothing imported): imports point one way, integrations -> api ->
ops -> kernels -> format, with no cycle between modules and no kernel module importing the layers above it.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a cycle that only a lazy import closes
still ties the two modules together, and is how kernels came to import the API layer (issue 41).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"moe_nvfp4": ROOT / "moe_nvfp4", "moe_nvfp4_vllm": ROOT / "integrations" / "moe_nvfp4_vllm"}
KERNEL_PACKAGES = ("moe_nvfp4.triton", "moe_nvfp4.cute")
BACKEND_FOLDERS = ("moe_nvfp4.sm90",)  # an architecture's backend: reached through the registry, never by name
# an architecture's backend folder holds its kernels and host, the config data below them and the tuner above them
KERNEL_MODULES = tuple(
    f"moe_nvfp4.sm90.{m}"
    for m in ("host", "gemm_triton", "gemm_gluon", "gemm_gluon_loader", "gemm_gluon_mma", "common", "fragment_pack")
)
# what sits above the kernels; the package itself re-exports the API, so importing it imports the API too
ABOVE_KERNELS = (
    "moe_nvfp4.api",
    "moe_nvfp4.prepare_weights",
    "moe_nvfp4.moe_inputs",
    "moe_nvfp4.grouped_gemm",
    "moe_nvfp4.ops",
    "moe_nvfp4.sm90.autotune",
    "moe_nvfp4.sm90.warmup",
    "moe_nvfp4.warmup",
    "moe_nvfp4.tune_cli",
    "moe_nvfp4.bench",
    "moe_nvfp4.cli",
    "moe_nvfp4.demo",
    "moe_nvfp4.convert",
    "moe_nvfp4_vllm",
)


def in_kernels(module: str) -> bool:
    return (
        module in KERNEL_PACKAGES
        or module in KERNEL_MODULES
        or module.startswith(tuple(f"{p}." for p in KERNEL_PACKAGES))
    )


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py under each package directory (a package is its __init__.py)."""
    found = {}
    for name, directory in packages.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` loads, or the package that holds it (``pkg.mod.attr`` -> ``pkg.mod``); None outside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, between the modules in ``known`` only."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # ``from pkg import mod`` loads pkg.mod when that is a module; ``from mod import name``, mod
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = _target(name, known)
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _described(cycle: list[str], graph: dict[str, dict[str, int]], known: dict[str, Path]) -> str:
    return " -> ".join(f"{known[a].relative_to(ROOT)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + (
        f" -> {known[cycle[-1]].relative_to(ROOT)}"
    )


def test_cycle_finder_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    """The check itself: a two-module loop whose second half is a lazy relative import is found, and named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("import os\n\n\ndef f():\n    from .sub.kernel import k\n    return k\n")
    (pkg / "sub" / "kernel.py").write_text("from ..low import f\nfrom pkg import low\nk = 1\n")
    (pkg / "top.py").write_text("from pkg.sub import kernel\n")
    known = modules({"pkg": pkg})
    graph = import_graph(known)
    assert graph["pkg.low"] == {"pkg.sub.kernel": 5} and graph["pkg.sub.kernel"] == {"pkg.low": 1}
    assert graph["pkg.top"] == {"pkg.sub.kernel": 1}
    assert find_cycle(graph) == ["pkg.low", "pkg.sub.kernel", "pkg.low"]
    del graph["pkg.sub.kernel"]["pkg.low"]
    assert find_cycle(graph) is None


def test_no_import_cycle_between_package_modules() -> None:
    known = modules(PACKAGES)
    assert {"moe_nvfp4.api", "moe_nvfp4.sm90.host", "moe_nvfp4_vllm.plugin"} <= set(known)
    graph = import_graph(known)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle (file:line of each import): {_described(cycle, graph, known)}"


def test_kernels_never_import_the_layers_above_them() -> None:
    known = modules(PACKAGES)
    graph = import_graph(known)
    kernels = [m for m in graph if in_kernels(m) and m not in KERNEL_PACKAGES]
    assert len(kernels) >= 10, kernels
    upward = [
        f"{known[m].relative_to(ROOT)}:{line} imports {target}"
        for m in kernels
        for target, line in graph[m].items()
        if target == "moe_nvfp4" or any(target == a or target.startswith(f"{a}.") for a in ABOVE_KERNELS)
    ]
    assert not upward, "kernel modules import the layers above them:\n" + "\n".join(upward)


def test_the_modules_under_the_kernels_never_import_them() -> None:
    """What the kernel packages import (formats, layouts, weights, routing, configs, ... and all they import) stands
    below them, so none of it may import a kernel module, not even a constant a kernel also reads: that import
    runs back up a floor (weight_layouts.py took GATE_UP_BLOCK from cute/tiles.py until issue 41)."""
    known = modules(PACKAGES)
    graph = import_graph(known)
    below, todo = set(), [t for m in graph if in_kernels(m) for t in graph[m] if not in_kernels(t)]
    while todo:
        m = todo.pop()
        if m not in below:
            below.add(m)
            todo.extend(graph[m])
    assert {"moe_nvfp4.formats", "moe_nvfp4.layouts", "moe_nvfp4.weights", "moe_nvfp4.weight_layouts"} <= below
    upward = [
        f"{known[m].relative_to(ROOT)}:{line} imports {target}"
        for m in sorted(below - {"moe_nvfp4"})
        for target, line in graph[m].items()
        if in_kernels(target)
    ]
    assert not upward, "modules under the kernels import them:\n" + "\n".join(upward)


def test_integrations_reach_the_kernels_only_through_the_api() -> None:
    """integrations -> api -> kernels: the vLLM plugin imports no kernel module and nothing of a backend's folder
    (the API and the registry's entries choose those); it imported the sm_90 autotune by name until issue 56."""
    known = modules(PACKAGES)
    graph = import_graph(known)
    plugin = [m for m in graph if m.split(".")[0] == "moe_nvfp4_vllm"]
    assert len(plugin) >= 5, plugin
    offenders = [
        f"{known[m].relative_to(ROOT)}:{line} imports {target}"
        for m in plugin
        for target, line in graph[m].items()
        if in_kernels(target) or target in BACKEND_FOLDERS or target.startswith(tuple(f"{b}." for b in BACKEND_FOLDERS))
    ]
    assert not offenders, "the plugin imports kernel or backend modules:\n" + "\n".join(offenders)
