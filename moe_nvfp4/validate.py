"""The one validator of an MoE layer's NVFP4 checkpoint tensors: ``inspect``, the converter's self-check and
the vLLM loader all call ``check_moe_layer`` and so reach the same verdict, naming the same tensor.

Input is the checkpoint's own tensors (raw: compressed-tensors reciprocals included), keyed
``experts[expert id][projection][suffix]``; every scale is converted to the kernel's convention (a multiplier)
BEFORE it is checked, so a compressed-tensors global scale of 1e-45 fails as the inf multiplier it becomes.

Checks, in order: every expected expert, projection and tensor is present; dtypes, shapes and scales
(``checkpoint.from_checkpoint``: global and input multipliers finite and positive, block scales not NaN/inf or
negative); no block scale of zero over non-zero codes (those weights would silently read as zero); W4A4 input
scales within ``INPUT_SCALE_OUTLIER_RATIO`` of their GEMM's median (kernels quantize all experts' activations
with one scale, the max over experts, so one absurd expert would zero the layer); gate and up global scales
that differ are a warning (both formats store one per projection and our loader keeps both exact; engines
that fuse w13 with one scale lose precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from .checkpoint import (
    SCAN_CHUNK_BYTES,
    TENSOR_NAMES,
    CheckpointError,
    Convention,
    NVFP4Linear,
    any_bad_block_scale,
    from_checkpoint,
    row_chunks,
)
from .formats import NVFP4

__all__ = [
    "Finding",
    "INPUT_SCALE_OUTLIER_RATIO",
    "check_moe_layer",
    "lost_blocks",
    "raise_first_error",
    "stacked_layer_clean",
]

# An expert's input scale more than this many times its GEMM's median is refused: the kernels quantize every
# expert's activations with the largest scale, so the others' block scales shrink by the same ratio; at 1e3 a
# block at the median expert's full range still has a normal e4m3 scale (448 / 1e3 > 2^-6), past about 2.3e5
# (448 * 2^9) every block scale underflows to zero and the layer's output is zero.
INPUT_SCALE_OUTLIER_RATIO = 1e3


@dataclass(frozen=True)
class Finding:
    """One problem: ``tensor`` is the full checkpoint name (``<layer>.<expert>.<projection>[.<suffix>]``)."""

    tensor: str
    message: str
    expert: int | None = None
    severity: str = "error"  # "error": engines would load wrong weights or fail; "warning": loads exactly here

    def __str__(self) -> str:
        where = "" if self.expert is None else f" (expert {self.expert})"
        return f"{self.tensor}{where}: {self.message}"


def _lost_mask(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Blocks whose e4m3 scale is zero (+0 or -0) although some code's magnitude is not."""
    magnitudes = (packed & 0x77).reshape(*packed.shape[:-1], -1, NVFP4.block_size // 2)
    return (magnitudes.amax(-1) > 0) & ((scale.view(torch.uint8) & 0x7F) == 0)


def lost_blocks(layer: NVFP4Linear) -> int:
    """Blocks whose scale is zero although their codes are not: their weights dequantize to zero."""
    return int(_lost_mask(layer.weight.packed, layer.weight.block_scale).sum())


def _any_lost_block(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """0-dim bool: ``_lost_mask`` anywhere in [..., N, K/2] / [..., N, K/16], in runs of rows (temporaries near
    SCAN_CHUNK_BYTES), no host synchronisation."""
    lost = torch.zeros((), dtype=torch.bool, device=packed.device)
    rows = max(1, SCAN_CHUNK_BYTES // max(1, packed.shape[-1]))
    for values, scales in zip(row_chunks(packed, rows), row_chunks(scale, rows)):
        lost |= _lost_mask(values, scales).any()
    return lost


def raise_first_error(findings: Iterable[Finding]) -> None:
    for f in findings:
        if f.severity == "error":
            raise CheckpointError(str(f))


def _check_projection(
    name: str, expert: int, tensors: Mapping[str, torch.Tensor], convention: Convention, need_input: bool
) -> tuple[list[Finding], NVFP4Linear | None]:
    packed_key, scale_key, global_key, input_key, _ = TENSOR_NAMES[convention]
    wanted = (packed_key, scale_key, global_key, *((input_key,) if need_input else ()))
    missing = [k for k in wanted if k not in tensors]
    if missing:
        why = " (a W4A4 checkpoint needs an input scale for every expert)" if missing == [input_key] else ""
        return [Finding(f"{name}.{missing[0]}", f"missing{why}", expert)], None
    try:
        layer = from_checkpoint(tensors, convention, name=name, expert=expert)
    except CheckpointError as e:
        return [Finding(e.tensor or name, e.reason, expert)], None
    lost = lost_blocks(layer)
    if lost:
        msg = f"{lost} block scales are zero over non-zero codes (those weights would read as 0)"
        return [Finding(f"{name}.{scale_key}", msg, expert)], None
    return [], layer


def _input_outliers(layer: str, scales: dict[tuple[int, str], float], input_key: str) -> list[Finding]:
    if len(scales) < 2:
        return []
    values = torch.tensor(list(scales.values()), dtype=torch.float64)
    median = float(values.median())
    (e, proj), worst = max(scales.items(), key=lambda kv: kv[1])
    if worst <= INPUT_SCALE_OUTLIER_RATIO * median:
        return []
    msg = (
        f"input scale {worst:.4g} is {worst / median:.3g}x the median {median:.4g} of this GEMM's experts "
        f"(bound {INPUT_SCALE_OUTLIER_RATIO:g}x); W4A4 quantizes every expert's activations with the largest, "
        "which would zero the others"
    )
    return [Finding(f"{layer}.{e}.{proj}.{input_key}", msg, e)]


def check_moe_layer(
    layer: str,
    experts: Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]],
    *,
    convention: Convention,
    expected_experts: Iterable[int],
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
    require_input_scales: bool = False,
) -> list[Finding]:
    """Every finding for one MoE layer, errors first per expert (see the module docstring).

    layer: the experts' prefix (``model.layers.0.mlp.experts``); experts: expert id -> projection name (as
    the checkpoint spells it, ``projections`` = gate, up, down; or up, down for non-gated experts such as
    Nemotron-H's) -> tensor suffix -> raw checkpoint tensor.
    Input scales are required when ``require_input_scales`` or when any expert has one.
    """
    if len(projections) not in (2, 3):
        raise ValueError(f"projections must name gate, up, down or up, down; got {projections}")
    gate, up, down = projections if len(projections) == 3 else (None, *projections)
    packed_key, _, global_key, input_key, _ = TENSOR_NAMES[convention]
    need_input = require_input_scales or any(input_key in t for ex in experts.values() for t in ex.values())
    findings: list[Finding] = []
    inputs: dict[str, dict[tuple[int, str], float]] = {"w13": {}, "w2": {}}
    for e in expected_experts:
        if e not in experts:
            findings.append(Finding(f"{layer}.{e}", f"missing (no {'/'.join(projections)} tensors)", e))
            continue
        read: dict[str, NVFP4Linear] = {}
        for proj in projections:
            if proj not in experts[e]:
                findings.append(Finding(f"{layer}.{e}.{proj}", f"missing (no {proj}.{packed_key} and scales)", e))
                continue
            problems, linear = _check_projection(f"{layer}.{e}.{proj}", e, experts[e][proj], convention, need_input)
            findings += problems
            if linear is not None:
                read[proj] = linear
                if linear.input_scale is not None:
                    inputs["w2" if proj == down else "w13"][(e, proj)] = float(linear.input_scale)
        if gate in read and up in read:
            g, u = float(read[gate].weight.global_scale), float(read[up].weight.global_scale)
            if g != u:
                msg = (
                    f"gate/up global scales differ (gate {g:.6g}, up {u:.6g}); loaded exactly here, but engines "
                    "fusing w13 with one scale lose precision"
                )
                findings.append(Finding(f"{layer}.{e}.{up}.{global_key}", msg, e, "warning"))
    for scales in inputs.values():
        findings += _input_outliers(layer, scales, input_key)
    return findings


def stacked_layer_clean(
    gemms: Mapping[str, Mapping[str, torch.Tensor]], *, convention: Convention, need_input: bool
) -> bool:
    """Whether ``check_moe_layer`` finds no error in a layer whose every expected tensor is present and stacked
    over experts, as vLLM's parameters hold them: ``gemms["w13" | "w2"][suffix]`` is [E, N, K/2] / [E, N, K/16]
    for the values and block scales, [E, projections] for the scalars.  The same value checks (multipliers finite
    and positive, block scales not NaN or negative, no zero scale over non-zero codes, input scales within the
    outlier bound) in a few passes and one host synchronisation, where check_moe_layer synchronises several times
    per expert and projection (Qwen3-30B-A3B: 18k projections, seconds of every start).  A screen, not a second
    verdict: where it says False the caller runs check_moe_layer for the findings; tests/test_validate.py holds
    the two to the same answer on every error case."""
    packed_key, scale_key, global_key, input_key, reciprocal = TENSOR_NAMES[convention]
    flags = []
    for tensors in gemms.values():
        for key in (global_key, input_key) if need_input else (global_key,):
            stored = tensors[key].float()
            multiplier = 1.0 / stored if reciprocal else stored
            flags.append((~torch.isfinite(multiplier) | (multiplier <= 0)).any())
            if key == input_key and multiplier.numel() >= 2:  # as _input_outliers: the largest against the median
                values = multiplier.double().flatten()
                flags.append(values.max() > INPUT_SCALE_OUTLIER_RATIO * values.median())
        flags.append(any_bad_block_scale(tensors[scale_key]))
        flags.append(_any_lost_block(tensors[packed_key], tensors[scale_key]))
    return not bool(torch.stack(flags).any())
