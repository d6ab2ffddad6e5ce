"""The offline converter: HF BF16/FP16/FP32 checkpoint -> NVFP4 (ModelOpt or compressed-tensors), streaming.

Peak memory is about one unit's float32 working set (an expert's gate+up, or one layer), not the model:
tensors are read one at a time from memory-mapped shards, and output shards are flushed as they fill.
Quantization is deterministic and gives the same bytes on CPU and GPU (exact float32 ops only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoint import Convention, NVFP4Linear, to_checkpoint
from ..formats import NVFP4, NVFP4Tensor, dequantize_nvfp4, global_scale_for, quantize_nvfp4
from .inspect import checkpoint_problems
from .plan import Plan, QuantUnit, Selection, make_plan
from .quant_config import QuantSettings, hf_quant_config, quantization_config
from .source import ConversionError, SourceCheckpoint, open_checkpoint
from .writer import ShardedWriter, atomic_output_dir, copy_non_weight_files, shard_metadata, write_json

__all__ = ["ConvertOptions", "ConvertSummary", "convert_checkpoint", "quantize_group", "verify_output"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
WARNINGS_SHOWN = 5  # the summary prints this many warnings, then a count


@dataclass(frozen=True)
class ConvertOptions:
    """Everything the converter can be told; the defaults quantize routed experts only, weight-only, ModelOpt."""

    selection: Selection = field(default_factory=Selection)
    settings: QuantSettings = field(default_factory=QuantSettings)
    device: str = "cpu"
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES


@dataclass(frozen=True)
class ConvertSummary:
    output: Path
    quantized_modules: int
    copied_tensors: int
    quantized_source_bytes: int  # source bytes of the tensors that were quantized
    bytes_before: int  # all source tensors
    bytes_after: int  # all output tensors
    seconds: float
    worst_relative_error: float  # max over modules of ||dequant - w|| / ||w||
    worst_module: str
    skipped: dict[str, str]
    warnings: tuple[str, ...] = ()  # outliers that cost an expert most of its values, NaN in copied tensors
    left_out: tuple[str, ...] = ()  # subdirectories of the source, not copied

    @property
    def gb_per_second(self) -> float:
        """Quantized source bytes (GB, 1e9) per second of wall time."""
        return self.quantized_source_bytes / 1e9 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        lines = [
            f"wrote {self.output}",
            f"  quantized modules: {self.quantized_modules} ({self.quantized_source_bytes / 1e9:.3f} GB of source weights)",
            f"  copied tensors:    {self.copied_tensors}",
            f"  size:              {self.bytes_before / 1e9:.3f} GB -> {self.bytes_after / 1e9:.3f} GB",
            f"  time:              {self.seconds:.1f} s ({self.gb_per_second:.3f} GB/s of quantized source)",
            f"  worst rel. error:  {self.worst_relative_error:.4f} ({self.worst_module})",
        ]
        lines += [f"  left unquantized:  {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"  not copied:        {name}/ (a subdirectory)" for name in self.left_out]
        lines += [f"  warning: {w}" for w in self.warnings[:WARNINGS_SHOWN]]
        if len(self.warnings) > WARNINGS_SHOWN:  # one per expert on a real model would bury the summary
            lines.append(
                f"  ... and {len(self.warnings) - WARNINGS_SHOWN} more warnings like these "
                f"({len(self.warnings)} in all; ConvertSummary.warnings lists every one)"
            )
        return "\n".join(lines)


def quantize_group(weights: list[torch.Tensor], *, share_global: bool) -> list[NVFP4Tensor]:
    """Quantize ``[N, K]`` weights; with ``share_global`` all get ``max`` of their own ModelOpt global scales."""
    if share_global:
        gs = torch.stack([global_scale_for(w) for w in weights]).amax()
        return [quantize_nvfp4(w, gs) for w in weights]
    return [quantize_nvfp4(w) for w in weights]


def _relative_error(w: torch.Tensor, q: NVFP4Tensor) -> float:
    wf = w.float()
    norm = float(torch.linalg.vector_norm(wf))
    return float(torch.linalg.vector_norm(dequantize_nvfp4(q) - wf)) / norm if norm > 0 else 0.0


def _where(unit: QuantUnit) -> str:
    return unit.source if unit.expert is None else f"{unit.source} (expert {unit.expert})"


# Warn when quantization zeroes more than this share of a module's non-zero weights (one huge outlier sets the
# global scale, and every ordinary block's e4m3 scale underflows).
ZEROED_WARNING_FRACTION = 0.5


def _zeroed_warning(where: str, module: str, w: torch.Tensor, q: NVFP4Tensor, err: float) -> str | None:
    nonzero = w != 0
    count = int(nonzero.sum())
    zeroed = int((nonzero & (dequantize_nvfp4(q) == 0)).sum())
    if not count or zeroed <= ZEROED_WARNING_FRACTION * count:
        return None
    return (
        f"{where}: {module}: {zeroed / count:.0%} of its non-zero weights quantize to 0 (relative error "
        f"{err:.3g}); the global scale {float(q.global_scale.max()):.4g} follows an outlier, largest |w| "
        f"{float(w.abs().max()):.4g}"
    )


def _run_unit(
    src: SourceCheckpoint, unit: QuantUnit, options: ConvertOptions, writer: ShardedWriter, warnings: list[str]
) -> float:
    """Quantize one unit and hand its tensors to the writer; return its worst relative error."""
    weights = [w.to(options.device) for w in unit.load(src)]
    for module, w in zip(unit.modules, weights):
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            raise ConversionError(
                f"{_where(unit)}: {int(bad.sum())} NaN/inf values in {module}; fix the source weights"
            )
    settings = options.settings
    input_scale = None if settings.input_scale is None else torch.tensor(settings.input_scale, dtype=torch.float32)
    worst = 0.0
    for module, w, q in zip(unit.modules, weights, quantize_group(weights, share_global=unit.share_global)):
        for suffix, t in to_checkpoint(NVFP4Linear(q, input_scale), settings.convention).items():
            writer.add(f"{module}.{suffix}", t)
        err = _relative_error(w, q)
        warning = _zeroed_warning(_where(unit), module, w.float(), q, err)
        if warning:
            warnings.append(warning)
        worst = max(worst, err)
    return worst


def _copy(src: SourceCheckpoint, name: str, writer: ShardedWriter, warnings: list[str]) -> None:
    t = src.load(name)
    if t.is_floating_point():
        nans = int(torch.isnan(t).sum())
        if nans:
            warnings.append(f"{name}: copied unchanged with {nans} NaN values")
    writer.add(name, t)


def verify_output(root: Path) -> None:
    """The converter's self-check: the validator ``inspect`` runs (``checkpoint_problems``) over the written
    checkpoint; ConversionError for its first error.  Warnings (separate gate/up scales asked for) pass."""
    with open_checkpoint(root) as out:
        report = checkpoint_problems(out)
    errors = [p for p in report.problems if p.severity == "error"]
    if errors:
        raise ConversionError(
            f"self-check of the output failed ({len(errors)} errors): {errors[0].module}: {errors[0].message}"
        )


def _check_device(device: str) -> None:
    """The device must hold real values: ``meta`` (shapes only) would write no weights, so it is refused by name."""
    try:
        probe = torch.ones(NVFP4.block_size, device=torch.device(device))
    except (RuntimeError, AssertionError, ValueError, TypeError) as e:
        raise ConversionError(f"--device {device}: not usable on this machine ({e})") from e
    if probe.is_meta:
        raise ConversionError(
            f"--device {device}: a meta device holds shapes, not values, so nothing could be "
            "quantized; use cpu or a GPU (e.g. cuda)"
        )
    try:
        float(probe.sum())
    except (RuntimeError, NotImplementedError) as e:
        raise ConversionError(f"--device {device}: cannot compute on it ({e}); use cpu or a GPU (e.g. cuda)") from e


def _write_configs(src: SourceCheckpoint, out: Path, settings: QuantSettings, plan: Plan) -> None:
    config = dict(src.config)
    config["quantization_config"] = quantization_config(settings, plan.ignore)
    write_json(out / "config.json", config)
    if settings.convention is Convention.MODELOPT:
        write_json(out / "hf_quant_config.json", hf_quant_config(settings, plan.ignore))


def convert_checkpoint(
    src_dir: str | Path, dst_dir: str | Path, options: ConvertOptions | None = None, *, progress: bool = True
) -> ConvertSummary:
    """Convert the HF checkpoint in ``src_dir`` to NVFP4 in ``dst_dir`` (which must not exist).

    Everything is written to a temp directory beside ``dst_dir`` and renamed at the end, so a failure leaves
    no partial output.  Raises ConversionError naming the file or tensor for any problem.
    """
    options = options or ConvertOptions()
    start = time.perf_counter()
    _check_device(options.device)
    warnings: list[str] = []
    with open_checkpoint(src_dir) as src:
        if not src.config:
            raise ConversionError(f"{src.root}: no config.json; the converter needs the model config to annotate it")
        if "quantization_config" in src.config:
            raise ConversionError(
                f"{src.root}/config.json already has a quantization_config; convert a BF16/FP16 checkpoint"
            )
        plan = make_plan(src, options.selection, separate_gate_up_scales=options.settings.separate_gate_up_scales)
        total = sum(info.nbytes for info in src.tensors.values())
        quantized_bytes = worst = 0.0
        worst_module = ""
        modules = copied = 0
        with atomic_output_dir(dst_dir) as out:
            writer = ShardedWriter(out, max_shard_bytes=options.max_shard_bytes, metadata=shard_metadata())
            with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
                for item in plan.work:
                    if isinstance(item, str):
                        _copy(src, item, writer, warnings)
                        copied += 1
                        bar.update(src.tensors[item].nbytes)
                        continue
                    err = _run_unit(src, item, options, writer, warnings)
                    if err >= worst:
                        worst, worst_module = err, _where(item)
                    modules += len(item.modules)
                    quantized_bytes += item.nbytes
                    bar.update(item.nbytes)
            writer.close()
            _write_configs(src, out, options.settings, plan)
            _, left_out = copy_non_weight_files(src.root, out)
            verify_output(out)
            bytes_after = writer.total_bytes
    return ConvertSummary(
        output=Path(dst_dir),
        quantized_modules=modules,
        copied_tensors=copied,
        quantized_source_bytes=int(quantized_bytes),
        bytes_before=total,
        bytes_after=bytes_after,
        seconds=time.perf_counter() - start,
        worst_relative_error=worst,
        worst_module=worst_module,
        skipped=plan.skipped,
        warnings=tuple(warnings),
        left_out=tuple(left_out),
    )
