"""Inspecting NVFP4 checkpoints (ModelOpt, compressed-tensors, ours) and repairing what can be repaired.

MoE layers go through ``moe_nvfp4.validate.check_moe_layer``, the validator the converter's self-check and
the vLLM loader call too; other quantized modules through ``checkpoint.from_checkpoint``.  A directory with
no NVFP4 tensor is an error.  Tensors are read one at a time from memory-mapped shards.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ..checkpoint import (
    TENSOR_NAMES,
    CheckpointError,
    Convention,
    NVFP4Linear,
    detect_convention,
    from_checkpoint,
    to_checkpoint,
)
from ..formats import dequantize_nvfp4, quantize_nvfp4
from ..validate import check_moe_layer, lost_blocks
from .names import PROJECTION_ROLES, Role, claimed_experts, expert_id_problem, gated_experts
from .quant_config import GATE_UP_SHARED, METADATA_KEY, read_settings
from .source import ConversionError, SourceCheckpoint, open_checkpoint
from .writer import ShardedWriter, atomic_output_dir, copy_non_weight_files, shard_metadata, write_json

__all__ = [
    "FIX_MAX_RELATIVE_ERROR",
    "JSON_SCHEMA_VERSION",
    "Problem",
    "InspectReport",
    "checkpoint_problems",
    "inspect_checkpoint",
    "fix_checkpoint",
]

_SUFFIXES = sorted({s for names in TENSOR_NAMES.values() for s in names[:4]}, key=len, reverse=True)
_EXPERT_TENSOR = re.compile(
    r"^(?P<layer>(?:.*\.)?experts)\.(?P<expert>\d+)\.(?P<proj>[a-z0-9_]+)\.(?P<suffix>" + "|".join(_SUFFIXES) + ")$"
)
_QUANTIZED_MARKERS = ("weight_scale", "weight_scale_2", "weight_packed", "weight_global_scale")
# --fix refuses a gate/up pair whose requantization to the shared (max) global scale moves a projection by
# more than this (||requantized - stored|| / ||stored||); ordinary pairs move by about one e2m1 step (< 0.12).
FIX_MAX_RELATIVE_ERROR = 0.25
PROBLEMS_SHOWN = 20  # the text report lists this many problems (besides the gate/up summary), then a count
JSON_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Problem:
    module: str  # the tensor (or module) at fault
    message: str
    severity: str = "error"  # "error" fails inspect; "warning" is reported (exit 3 when nothing else is)
    fixable: bool = False

    def __str__(self) -> str:
        fix = " [fixable with --fix]" if self.fixable else ""
        return f"{self.severity}: {self.module}: {self.message}{fix}"


@dataclass(frozen=True)
class InspectReport:
    """What ``inspect`` found.  ``str()`` is the text report (repeated gate/up warnings summed up in one line, at
    most ``PROBLEMS_SHOWN`` other problems); ``to_json()`` the machine-readable one, every problem listed."""

    root: Path
    conventions: tuple[str, ...]
    quant_algo: str | None
    metadata: dict[str, Any] | None
    quantized_modules: int
    experts_per_layer: dict[str, int]  # ``...experts`` prefix -> number of experts
    shapes: dict[str, tuple[int, int]]  # projection role -> unquantized [N, K] (first seen)
    problems: list[Problem] = field(default_factory=list)
    gate_up_pairs: list[tuple[str, str, int]] = field(
        default_factory=list
    )  # (gate module, up module, expert) differing

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def exit_code(self) -> int:
        """0: no problems; 1: errors; 3: warnings only (as ``moe-nvfp4 inspect --help`` says)."""
        return 0 if not self.problems else 3 if self.ok else 1

    def _gate_up_summary(self) -> str | None:
        """One line for every expert whose gate and up global scales differ (one warning each: thousands on a
        real model)."""
        if not self.gate_up_pairs:
            return None
        per_layer = Counter(gate.rsplit(".", 2)[0] for gate, _, _ in self.gate_up_pairs)
        counts = set(per_layer.values())
        where = (
            f"{counts.pop()} experts x {len(per_layer)} layers"
            if len(counts) == 1
            else f"{len(self.gate_up_pairs)} experts over {len(per_layer)} layers"
        )
        first = next(p for p in self.problems if p.fixable)
        return (
            f"warning: {where} have separate gate/up global scales (first: {first.module}: {first.message}) "
            "[fixable with --fix]"
        )

    def __str__(self) -> str:
        lines = [
            f"{self.root}",
            f"  format:    {', '.join(self.conventions) or 'no NVFP4 tensors'}; quant_algo {self.quant_algo}",
            f"  ours:      {_metadata_text(self.metadata)}" if self.metadata else "  ours:      no moe_nvfp4 metadata",
            f"  quantized: {self.quantized_modules} modules; {len(self.experts_per_layer)} MoE layers",
        ]
        lines += [f"    {prefix}: {n} experts" for prefix, n in self.experts_per_layer.items()]
        lines += [f"    {role}: [N, K] = {list(shape)}" for role, shape in self.shapes.items()]
        lines.append(f"  problems:  {len(self.problems)}" + ("" if self.problems else " (OK)"))
        summary = self._gate_up_summary()
        if summary:
            lines.append(f"    {summary}")
        others = [p for p in self.problems if not p.fixable]
        lines += [f"    {p}" for p in others[:PROBLEMS_SHOWN]]
        if len(others) > PROBLEMS_SHOWN:
            lines.append(f"    ... and {len(others) - PROBLEMS_SHOWN} more (inspect --json lists every one)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``inspect --json``), schema version ``JSON_SCHEMA_VERSION``:

        ``schema`` int; ``root`` str; ``formats`` list of "modelopt" / "compressed-tensors"; ``quant_algo`` str
        or null; ``moe_nvfp4`` object (the converter's metadata) or null; ``quantized_modules`` int;
        ``moe_layers`` {layer prefix: number of experts}; ``shapes`` {"gate" | "up" | "down" | "linear": [N, K]};
        ``ok`` bool (no errors); ``exit_code`` int (0, 1 or 3, as the command's); ``problems`` list of
        {``module`` str, ``severity`` "error" | "warning", ``message`` str, ``fixable`` bool}, every one.
        """
        return {
            "schema": JSON_SCHEMA_VERSION,
            "root": str(self.root),
            "formats": list(self.conventions),
            "quant_algo": self.quant_algo,
            "moe_nvfp4": self.metadata,
            "quantized_modules": self.quantized_modules,
            "moe_layers": dict(self.experts_per_layer),
            "shapes": {role: list(shape) for role, shape in self.shapes.items()},
            "ok": self.ok,
            "exit_code": self.exit_code,
            "problems": [
                {"module": p.module, "severity": p.severity, "message": p.message, "fixable": p.fixable}
                for p in self.problems
            ],
        }


def _metadata_text(metadata: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in metadata.items())


class _LazyTensors(Mapping[str, torch.Tensor]):
    """suffix -> tensor, read from the shard on each access (a layer's experts never sit in memory at once)."""

    def __init__(self, src: SourceCheckpoint, names: dict[str, str]):
        self.src, self.names = src, names

    def __getitem__(self, suffix: str) -> torch.Tensor:
        return self.src.load(self.names[suffix])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _expert_layers(src: SourceCheckpoint) -> dict[str, dict[int, dict[str, dict[str, str]]]]:
    """Quantized MoE layers: prefix -> expert -> projection -> suffix -> tensor name."""
    layers: dict[str, dict[int, dict[str, dict[str, str]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(dict))
    )
    for name in src.tensors:
        m = _EXPERT_TENSOR.match(name)
        if m and m["proj"] in PROJECTION_ROLES:
            layers[m["layer"]][int(m["expert"])][m["proj"]][m["suffix"]] = name
    quantized = lambda experts: any(  # noqa: E731
        k in _QUANTIZED_MARKERS for projs in experts.values() for suffixes in projs.values() for k in suffixes
    )
    return {prefix: experts for prefix, experts in layers.items() if quantized(experts)}


def _projections(experts: dict[int, dict[str, dict[str, str]]], gated: bool) -> tuple[str, ...]:
    """The layer's gate, up, down names (up, down where the config's experts are non-gated, as NemotronH's)."""
    if not gated:
        return "up_proj", "down_proj"
    names = {p for projs in experts.values() for p in projs}
    return (
        ("gate_proj", "up_proj", "down_proj") if names & {"gate_proj", "up_proj", "down_proj"} else ("w1", "w3", "w2")
    )


def _convention(experts: dict[int, dict[str, dict[str, str]]]) -> Convention:
    packed = any("weight_packed" in s for projs in experts.values() for s in projs.values())
    return Convention.COMPRESSED_TENSORS if packed else Convention.MODELOPT


def _modules(src: SourceCheckpoint, skip: set[str]) -> dict[str, dict[str, str]]:
    """Quantized modules outside MoE layers: name -> {suffix: tensor name}, in file order."""
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for name in src.tensors:
        if name in skip:
            continue
        for suffix in _SUFFIXES:
            if name.endswith("." + suffix):
                groups[name[: -len(suffix) - 1]][suffix] = name
                break
    return {m: g for m, g in groups.items() if any(k in g for k in _QUANTIZED_MARKERS)}


def _read(src: SourceCheckpoint, module: str, names: dict[str, str]) -> tuple[Convention, NVFP4Linear]:
    tensors = {suffix: src.load(name) for suffix, name in names.items()}
    convention = detect_convention(tensors)
    return convention, from_checkpoint(tensors, convention, name=module)


@dataclass
class _Scan:
    """What checking a checkpoint's modules collects on the way."""

    problems: list[Problem] = field(default_factory=list)
    conventions: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # role (or "linear") -> (N, K)
    pairs: list[tuple[str, str, int]] = field(default_factory=list)  # gate/up modules whose global scales differ
    quantized: int = 0


def _check_expert_layers(src: SourceCheckpoint, layers: dict, w4a4: bool | None, scan: _Scan) -> None:
    """Every MoE layer through ``check_moe_layer``, over the experts present."""
    claimed = claimed_experts(src.config)
    for prefix, experts in layers.items():
        convention = _convention(experts)
        scan.conventions.add(convention.value)
        projections = _projections(experts, gated_experts(src.config))
        lazy = {e: {p: _LazyTensors(src, names) for p, names in projs.items()} for e, projs in experts.items()}
        ids = sorted(experts)  # the experts present, never a claimed count: a hostile one would loop for ever
        wrong_ids = expert_id_problem(prefix, ids, claimed)
        if wrong_ids:
            scan.problems.append(Problem(*wrong_ids))
        for f in check_moe_layer(
            prefix,
            lazy,
            convention=convention,
            expected_experts=ids,
            projections=projections,
            require_input_scales=bool(w4a4),
        ):
            gate_up = f.severity == "warning"
            scan.problems.append(Problem(f.tensor, f.message, f.severity, fixable=gate_up))
            if gate_up:
                scan.pairs.append(
                    (f"{prefix}.{f.expert}.{projections[0]}", f"{prefix}.{f.expert}.{projections[1]}", f.expert)
                )
        scan.quantized += sum(len(projs) for projs in experts.values())
        packed_key = TENSOR_NAMES[convention][0]
        for role, proj in zip(Role if len(projections) == 3 else (Role.UP, Role.DOWN), projections):
            first = next((projs[proj] for projs in experts.values() if packed_key in projs.get(proj, {})), None)
            shape = () if first is None else src.tensors[first[packed_key]].shape
            if len(shape) == 2:
                scan.shapes.setdefault(role.value, (shape[0], 2 * shape[1]))


def _check_linear_modules(
    src: SourceCheckpoint, layers: dict, algo: str | None, w4a4: bool | None, scan: _Scan
) -> None:
    """Every quantized module outside the MoE layers, read and checked alone."""
    in_layers = {
        n for experts in layers.values() for projs in experts.values() for s in projs.values() for n in s.values()
    }
    modules = _modules(src, in_layers)
    with_input = without_input = 0
    for module, names in modules.items():
        try:
            convention, layer = _read(src, module, names)
        except CheckpointError as e:
            scan.problems.append(Problem(e.tensor or module, e.reason))
            continue
        scan.conventions.add(convention.value)
        lost = lost_blocks(layer)
        if lost:
            scan.problems.append(
                Problem(
                    f"{module}.{TENSOR_NAMES[convention][1]}",
                    f"{lost} block scales are zero over non-zero codes (those weights would read as 0)",
                )
            )
        if layer.input_scale is None:
            without_input += 1
            if w4a4:
                scan.problems.append(Problem(module, f"missing input scale, required by quant_algo {algo} (W4A4)"))
        else:
            with_input += 1
        scan.shapes.setdefault("linear", (layer.weight.n, layer.weight.k))
    if w4a4 is None and with_input and without_input:
        total = with_input + without_input
        scan.problems.append(
            Problem(str(src.root), f"missing input scales: {without_input} of {total} layers have none")
        )
    scan.quantized += len(modules)


def checkpoint_problems(src: SourceCheckpoint) -> InspectReport:
    """Every problem of an opened checkpoint: the check ``inspect`` prints and the converter runs on its output."""
    algo, w4a4, ours = read_settings(src.config)
    layers = _expert_layers(src)
    scan = _Scan()
    _check_expert_layers(src, layers, w4a4, scan)
    _check_linear_modules(src, layers, algo, w4a4, scan)
    if not scan.quantized:
        scan.problems.append(
            Problem(
                str(src.root),
                "no NVFP4 tensors (no weight_scale / weight_scale_2 / weight_packed); not an NVFP4 checkpoint",
            )
        )
    return InspectReport(
        root=src.root,
        conventions=tuple(sorted(scan.conventions)),
        quant_algo=algo,
        metadata=ours,
        quantized_modules=scan.quantized,
        experts_per_layer={p: len(es) for p, es in layers.items()},
        shapes=scan.shapes,
        problems=scan.problems,
        gate_up_pairs=scan.pairs,
    )


def inspect_checkpoint(root: str | Path) -> InspectReport:
    """Read every quantized module of the checkpoint in ``root`` and list every problem found."""
    with open_checkpoint(root) as src:
        return checkpoint_problems(src)


def _relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(old))
    return float(torch.linalg.vector_norm(new - old)) / norm if norm > 0 else 0.0


def _shared_pair(src: SourceCheckpoint, gate: str, up: str, expert: int) -> dict[str, torch.Tensor]:
    """Gate and up requantized with the max of their global scales; refused past ``FIX_MAX_RELATIVE_ERROR``."""
    names = {m: {s: f"{m}.{s}" for s in _SUFFIXES if f"{m}.{s}" in src.tensors} for m in (gate, up)}
    read = {m: _read(src, m, names[m]) for m in (gate, up)}
    shared = torch.maximum(read[gate][1].weight.global_scale, read[up][1].weight.global_scale)
    out = {}
    for module, (convention, layer) in read.items():
        stored = dequantize_nvfp4(layer.weight)
        q = quantize_nvfp4(stored, shared)
        err = _relative_change(dequantize_nvfp4(q), stored)
        if err > FIX_MAX_RELATIVE_ERROR:
            raise ConversionError(
                f"{module} (expert {expert}): requantizing to the shared global scale {float(shared):.4g} would cost "
                f"relative error {err:.3g} (bound {FIX_MAX_RELATIVE_ERROR}); not fixed: the two scales are too far "
                "apart (an outlier?), reconvert the expert from its source weights"
            )
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

    Gate/up pairs with different global scales get the shared max scale, unless that costs a projection more
    than ``FIX_MAX_RELATIVE_ERROR`` (ConversionError naming the expert).  Other problems are carried over
    unchanged (the returned report still lists them).  The output appears atomically or not at all.
    """
    report = inspect_checkpoint(root)
    root = Path(root)
    with open_checkpoint(root) as src, atomic_output_dir(out_dir) as out:
        order = {name: i for i, name in enumerate(src.tensors)}
        fixes: dict[str, tuple[str, str, int]] = {}  # first tensor of the pair -> (gate, up, expert)
        owned: set[str] = set()
        for gate, up, expert in report.gate_up_pairs:
            names = [n for n in src.tensors if n.startswith((gate + ".", up + "."))]
            fixes[min(names, key=order.__getitem__)] = (gate, up, expert)
            owned.update(names)
        writer = ShardedWriter(out, max_shard_bytes=max_shard_bytes, metadata=shard_metadata())
        for name in src.tensors:
            if name in fixes:
                for n, t in _shared_pair(src, *fixes[name]).items():
                    writer.add(n, t)
            elif name not in owned:
                writer.add(name, src.load(name))
        writer.close()
        for config_name in ("config.json", "hf_quant_config.json"):
            if (root / config_name).exists():
                config = _fixed_config(root / config_name) if fixes else json.loads((root / config_name).read_text())
                write_json(out / config_name, config)
        copy_non_weight_files(root, out)
    return inspect_checkpoint(out_dir)
