"""Which config serves an sm_90 MoE call: ``select_config(tokens, LayerShape, DeviceTraits)`` takes, first that
has entries for the shape:
1. entries an autotuner measured in this process (``register_entries``; ``sm90.autotune``);
2. the tuned file that serves the device (``tuned_file_for``: ``configs/fused_moe_sm90/<device name>.json``, else
   a file tuned on a part of the same capability and SM count):
     {"meta": {"kernel": "fused_moe_sm90", "version": 3, "device": "NVIDIA H200", "capability": [9, 0],
               "sm_count": 132, "memory_gib": 140, ...},
      "entries": [{"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16",
                   "max_tokens": 16, "config": {...MoEKernelConfig fields...}}, ...]}
   (``global_experts`` in an entry: the routing's expert count under expert parallelism; absent, ``experts``);
3. ``default_config.default_config``, a deterministic model of the problem and the device.
An entry serves token counts up to ``max_tokens`` (the smallest such entry wins); past every entry of a shape,
default_config serves: an entry's max_tokens ends where it stopped winning (design 004 decision 12), and the default
is the rule measured at every size.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ..shapes import DeviceTraits, LayerShape
from .configs import CONFIG_VERSION, KERNEL_NAME, MoEKernelConfig
from .default_config import default_bounds, default_config

__all__ = [
    "CONFIG_DIR",
    "config_path",
    "configs_up_to",
    "entries_for",
    "entry_shape",
    "load_config_file",
    "measured_entries",
    "register_entries",
    "select_config",
    "serving_entry",
    "tuned_file_for",
]

CONFIG_DIR = Path(os.environ.get("MOE_NVFP4_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))


@lru_cache(maxsize=None)
def load_config_file(path: str) -> tuple[dict, tuple[dict, ...]]:
    """Read and check one tuned file; returns (meta, entries).  Raises ValueError on a bad file."""
    data = json.loads(Path(path).read_text())
    meta = data.get("meta", {})
    if meta.get("kernel") != KERNEL_NAME or meta.get("version") != CONFIG_VERSION:
        raise ValueError(f"{path}: expected meta kernel={KERNEL_NAME!r} version={CONFIG_VERSION}, got {meta}")
    entries = tuple(data.get("entries", ()))
    for i, entry in enumerate(entries):
        for key in ("experts", "top_k", "hidden", "intermediate", "dtype", "max_tokens", "config"):
            if key not in entry:
                raise ValueError(f"{path}: entry {i} lacks {key!r}")
        cfg = MoEKernelConfig.from_dict(entry["config"])
        if not entry_shape(entry).accepts(cfg):
            raise ValueError(f"{path}: entry {i} has an invalid config {cfg}")
    return meta, entries


def config_path(device_name: str, config_dir: Path | None = None) -> Path:
    """Where a device's tuned configs live under ``config_dir`` (default CONFIG_DIR, read at the call:
    MOE_NVFP4_CONFIG_DIR or the shipped configs/)."""
    return (CONFIG_DIR if config_dir is None else config_dir) / KERNEL_NAME / (device_name.replace(" ", "_") + ".json")


def tuned_file_for(device: DeviceTraits, config_dir: Path | None = None) -> Path | None:
    """The tuned file that serves ``device``: its own (by name), else one tuned on a part of the same
    compute capability and SM count (the files' meta records both; an H100 NVL or a GH200 has no file of its
    own), the one whose memory size is nearest (HBM3 against HBM3e); None if there is none."""
    own = config_path(device.name, config_dir)
    if own.exists():
        return own
    same = []
    for path in sorted(own.parent.glob("*.json")):
        meta = load_config_file(str(path))[0]
        if tuple(meta.get("capability", ())) == device.capability and meta.get("sm_count") == device.sm_count:
            same.append((abs(meta.get("memory_gib", 0) - device.memory_gib), path))
    return min(same)[1] if same else None


# Entries an autotuner measured in this process (autotune.autotune_fused_moe), by device name and shape
# (LayerShape.entry_key): they serve their shape before any file's entries.
_MEASURED: dict[str, dict[tuple, list[dict]]] = {}


def register_entries(device: DeviceTraits, entries: Sequence[dict]) -> None:
    """Serve ``entries`` (dicts as in a tuned file) on ``device`` from now on in this process, ahead of the tuned
    file's entries for the same shapes; an entry with the same shape and max_tokens as an earlier one replaces it.
    Every entry is checked before any is kept."""
    for entry in entries:
        cfg = MoEKernelConfig.from_dict(entry["config"])
        if not entry_shape(entry).accepts(cfg):
            raise ValueError(
                f"entry for {entry_shape(entry)} up to {entry['max_tokens']} tokens has an invalid config {cfg}"
            )
    table = _MEASURED.setdefault(device.name, {})
    for entry in entries:
        key = entry_shape(entry).entry_key
        table[key] = [e for e in table.get(key, []) if e["max_tokens"] != entry["max_tokens"]] + [entry]


def entry_shape(entry: dict) -> LayerShape:
    """The layer shape a tuned entry is for (``global_experts`` defaults to ``experts``: no expert parallelism;
    ``gated`` to True)."""
    return LayerShape(
        entry["experts"],
        entry["top_k"],
        entry["hidden"],
        entry["intermediate"],
        entry["dtype"],
        entry.get("global_experts", 0),
        entry.get("gated", True),
    )


def measured_entries(shape: LayerShape, device: DeviceTraits) -> list[dict]:
    """The entries registered for ``shape`` on ``device`` in this process (register_entries)."""
    return _MEASURED.get(device.name, {}).get(shape.entry_key, [])


def entries_for(shape: LayerShape, device: DeviceTraits) -> list[dict]:
    """The entries that serve ``shape`` on ``device``: measured in this process if any, else the tuned file's."""
    return measured_entries(shape, device) or _tuned_entries(device).get(shape.entry_key, [])


def select_config(tokens: int, shape: LayerShape, device: DeviceTraits) -> MoEKernelConfig:
    """The config for ``tokens`` of ``shape`` on ``device``: of its entries (entries_for), the one with the
    smallest max_tokens >= tokens; without one (no entries, or past every entry), default_config."""
    entry = serving_entry(entries_for(shape, device), tokens)
    if entry is not None:
        return MoEKernelConfig.from_dict(entry["config"])
    return default_config(
        tokens,
        shape.experts,
        shape.top_k,
        shape.hidden,
        shape.intermediate,
        global_experts=shape.global_experts,
        device=device,
        gated=shape.gated,
    )


def serving_entry(entries: Sequence[dict], tokens: int) -> dict | None:
    """Of one shape's tuned entries, the one that serves ``tokens``: the smallest max_tokens >= tokens; None past
    every entry (default_config serves there)."""
    fits = [e for e in entries if e["max_tokens"] >= tokens]
    return min(fits, key=lambda e: e["max_tokens"]) if fits else None


def configs_up_to(max_tokens: int, shape: LayerShape, device: DeviceTraits) -> dict[MoEKernelConfig, int]:
    """Every config ``select_config`` picks for 1..max_tokens tokens, each with the fewest tokens that pick it.

    select_config is constant between the token counts where an entry or a default_config bound ends, so
    checking 1 and each count just past such an end finds every config (what a warm-up must compile); past the
    last entry the default's bounds hold.
    """
    entries = entries_for(shape, device)
    last = max((e["max_tokens"] for e in entries), default=0)
    ends = [e["max_tokens"] for e in entries] + [b for b in default_bounds(shape, device) if b > last]
    found: dict[MoEKernelConfig, int] = {}
    for tokens in sorted({1} | {end + 1 for end in ends if 0 < end < max_tokens}):
        found.setdefault(select_config(tokens, shape, device), tokens)
    return found


@lru_cache(maxsize=None)
def _tuned_entries(device: DeviceTraits) -> dict[tuple, list[dict]]:
    """The entries of the file that serves ``device`` (tuned_file_for) by shape, read once per process
    (select_config runs on every forward)."""
    path = tuned_file_for(device)
    by_shape: dict[tuple, list[dict]] = {}
    for entry in load_config_file(str(path))[1] if path is not None else ():
        by_shape.setdefault(entry_shape(entry).entry_key, []).append(entry)
    return by_shape
