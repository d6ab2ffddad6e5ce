"""Inspecting NVFP4 checkpoints (ModelOpt, compressed-tensors, ours) and repairing what can be repaired.

Every quantized module is read (one at a time) and checked with ``checkpoint.from_checkpoint``; on top of
that: block scales of zero over non-zero codes (weights lost), gate/up global scales that differ (engines
fusing w13 use one), and missing input scales where the config declares W4A4.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import TENSOR_NAMES, CheckpointError, Convention, NVFP4Linear, detect_convention, from_checkpoint, to_checkpoint
from ..formats import NVFP4, dequantize_nvfp4, quantize_nvfp4, unpack_fp4
from .convert import shard_metadata
from .names import ExpertWeight, Role, classify
from .quant_config import GATE_UP_SEPARATE, GATE_UP_SHARED, METADATA_KEY, read_settings
from .source import SourceCheckpoint, open_checkpoint
from .writer import ShardedWriter, atomic_output_dir, copy_non_weight_files, write_json

__all__ = ["Problem", "InspectReport", "inspect_checkpoint", "fix_checkpoint"]

_SUFFIXES = sorted({s for names in TENSOR_NAMES.values() for s in names[:4]}, key=len, reverse=True)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
GATE_UP_MISMATCH = "gate/up global scales differ"


@dataclass(frozen=True)
class Problem:
    module: str
    message: str
    severity: str = "error"  # "error" fails inspect; "warning" is reported only
    fixable: bool = False

    def __str__(self) -> str:
        fix = " [fixable with --fix]" if self.fixable else ""
        return f"{self.severity}: {self.module}: {self.message}{fix}"


@dataclass(frozen=True)
class InspectReport:
    root: Path
    conventions: tuple[str, ...]
    quant_algo: str | None
    metadata: dict[str, Any] | None
    quantized_modules: int
    experts_per_layer: dict[str, int]  # ``...experts`` prefix -> number of experts
    shapes: dict[str, tuple[int, int]]  # projection role -> unquantized [N, K] (first seen)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def __str__(self) -> str:
        lines = [
            f"{self.root}",
            f"  format:    {', '.join(self.conventions) or 'no NVFP4 tensors'}; quant_algo {self.quant_algo}",
            f"  ours:      {self.metadata}" if self.metadata else "  ours:      no moe_nvfp4 metadata",
            f"  quantized: {self.quantized_modules} modules; {len(self.experts_per_layer)} MoE layers",
        ]
        lines += [f"    {prefix}: {n} experts" for prefix, n in self.experts_per_layer.items()]
        lines += [f"    {role}: [N, K] = {list(shape)}" for role, shape in self.shapes.items()]
        lines.append(f"  problems:  {len(self.problems)}" + ("" if self.problems else " (OK)"))
        lines += [f"    {p}" for p in self.problems]
        return "\n".join(lines)


def _modules(src: SourceCheckpoint) -> dict[str, dict[str, str]]:
    """Quantized module name -> {suffix: tensor name}, in file order."""
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for name in src.tensors:
        for suffix in _SUFFIXES:
            if name.endswith("." + suffix):
                groups[name[: -len(suffix) - 1]][suffix] = name
                break
    markers = ("weight_scale_2", "weight_packed", "weight_global_scale")
    return {m: g for m, g in groups.items() if any(k in g for k in markers)}


def _expert_of(module: str) -> int | None:
    m = _EXPERT.search(module + ".")
    return int(m[1]) if m else None


def _read(src: SourceCheckpoint, module: str, names: dict[str, str]) -> tuple[Convention, NVFP4Linear]:
    tensors = {suffix: src.load(name) for suffix, name in names.items()}
    convention = detect_convention(tensors)
    return convention, from_checkpoint(tensors, convention, name=module, expert=_expert_of(module))


def _lost_blocks(layer: NVFP4Linear) -> int:
    """Blocks whose scale is zero although their codes are not: their weights dequantize to zero."""
    w = layer.weight
    codes = unpack_fp4(w.packed) & 0x7
    nonzero = codes.reshape(*codes.shape[:-1], -1, NVFP4.block_size).amax(-1) > 0
    return int(((w.block_scale.float() == 0) & nonzero).sum())


def inspect_checkpoint(root: str | Path) -> InspectReport:
    """Read every quantized module of the checkpoint in ``root`` and list every problem found."""
    root = Path(root)
    with open_checkpoint(root) as src:
        algo, w4a4, ours = read_settings(src.config)
        problems: list[Problem] = []
        conventions: set[str] = set()
        experts: dict[str, set[int]] = defaultdict(set)
        shapes: dict[str, tuple[int, int]] = {}
        gate_up: dict[tuple[str, int], dict[Role, tuple[str, float]]] = defaultdict(dict)
        with_input = without_input = 0
        modules = _modules(src)
        for module, names in modules.items():
            try:
                convention, layer = _read(src, module, names)
            except CheckpointError as e:
                problems.append(Problem(module, str(e)))
                continue
            conventions.add(convention.value)
            lost = _lost_blocks(layer)
            if lost:
                problems.append(Problem(module, f"{lost} block scales are zero over non-zero codes (those weights read as 0)"))
            if layer.input_scale is None:
                without_input += 1
                if w4a4:
                    problems.append(Problem(module, f"missing input scale, required by quant_algo {algo} (W4A4)"))
            else:
                with_input += 1
            kind = classify(module + ".weight", (layer.weight.n, layer.weight.k))
            role = kind.role.value if isinstance(kind, ExpertWeight) else "linear"
            shapes.setdefault(role, (layer.weight.n, layer.weight.k))
            if isinstance(kind, ExpertWeight):
                experts[kind.prefix].add(kind.expert)
                if kind.role is not Role.DOWN:
                    gate_up[(kind.prefix, kind.expert)][kind.role] = (module, float(layer.weight.global_scale))
        if w4a4 is None and with_input and without_input:
            problems.append(Problem(str(root), f"missing input scales: {without_input} of {with_input + without_input} layers have none"))
        declared_separate = (ours or {}).get("gate_up_global_scale") == GATE_UP_SEPARATE
        for (prefix, e), pair in gate_up.items():
            if len(pair) == 2 and pair[Role.GATE][1] != pair[Role.UP][1]:
                g, u = pair[Role.GATE][1], pair[Role.UP][1]
                problems.append(Problem(
                    f"{prefix}.{e}",
                    f"{GATE_UP_MISMATCH} (gate {g:.6g}, up {u:.6g}); engines fusing w13 use one scale",
                    "warning" if declared_separate else "error",
                    fixable=True,
                ))  # fmt: skip
        return InspectReport(
            root=root,
            conventions=tuple(sorted(conventions)),
            quant_algo=algo,
            metadata=ours,
            quantized_modules=len(modules),
            experts_per_layer={p: len(es) for p, es in experts.items()},
            shapes=shapes,
            problems=problems,
        )


def _shared_pair(src: SourceCheckpoint, gate: str, up: str, modules: dict[str, dict[str, str]]) -> dict[str, torch.Tensor]:
    """Gate and up requantized exactly: dequantize both, requantize with the max of their global scales."""
    out = {}
    read = {m: _read(src, m, modules[m]) for m in (gate, up)}
    shared = torch.maximum(read[gate][1].weight.global_scale, read[up][1].weight.global_scale)
    for module, (convention, layer) in read.items():
        q = quantize_nvfp4(dequantize_nvfp4(layer.weight), shared)
        for suffix, t in to_checkpoint(NVFP4Linear(q, layer.input_scale), convention).items():
            out[f"{module}.{suffix}"] = t
    return out


def _fixed_config(path: Path) -> dict[str, Any]:
    config = json.loads(path.read_text())
    for holder in (config, config.get("quantization_config")):
        if isinstance(holder, dict) and isinstance(holder.get(METADATA_KEY), dict):
            holder[METADATA_KEY]["gate_up_global_scale"] = GATE_UP_SHARED
    return config


def fix_checkpoint(root: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 5 * 10**9) -> InspectReport:
    """Write ``root`` to ``out_dir`` with every fixable problem repaired; return the report of the output.

    Gate/up pairs with different global scales get the shared max scale.  Other problems are carried over
    unchanged (the returned report still lists them).  The output appears atomically or not at all.
    """
    report = inspect_checkpoint(root)
    root = Path(root)
    pairs = [p.module for p in report.problems if p.fixable and p.message.startswith(GATE_UP_MISMATCH)]
    with open_checkpoint(root) as src, atomic_output_dir(out_dir) as out:
        modules = _modules(src)
        by_expert: dict[str, dict[Role, str]] = defaultdict(dict)
        for m in modules:
            kind = classify(m + ".weight", (1, 1))
            if isinstance(kind, ExpertWeight):
                by_expert[f"{kind.prefix}.{kind.expert}"][kind.role] = m
        order = {name: i for i, name in enumerate(src.tensors)}
        fixes: dict[str, tuple[str, str]] = {}  # first tensor of the pair -> (gate module, up module)
        owned: set[str] = set()
        for expert_module in pairs:
            gate, up = by_expert[expert_module][Role.GATE], by_expert[expert_module][Role.UP]
            names = [*modules[gate].values(), *modules[up].values()]
            fixes[min(names, key=order.__getitem__)] = (gate, up)
            owned.update(names)
        writer = ShardedWriter(out, max_shard_bytes=max_shard_bytes, metadata=shard_metadata())
        for name in src.tensors:
            if name in fixes:
                for n, t in _shared_pair(src, *fixes[name], modules).items():
                    writer.add(n, t)
            elif name not in owned:
                writer.add(name, src.load(name))
        writer.close()
        for config_name in ("config.json", "hf_quant_config.json"):
            if (root / config_name).exists():
                config = _fixed_config(root / config_name) if pairs else json.loads((root / config_name).read_text())
                write_json(out / config_name, config)
        copy_non_weight_files(root, out)
    return inspect_checkpoint(out_dir)
