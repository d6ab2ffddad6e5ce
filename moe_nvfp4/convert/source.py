"""Reading a local HF checkpoint directory tensor by tensor (safetensors, memory-mapped, never whole)."""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["ConversionError", "SourceCheckpoint", "TensorInfo", "open_checkpoint", "DTYPE_BYTES"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype string -> bytes per element
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class ConversionError(ValueError):
    """The checkpoint cannot be converted; the message names the file or tensor and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: where it lives, its safetensors dtype string and shape."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES.get(self.dtype, 1)
        for d in self.shape:
            n *= d
        return n


class SourceCheckpoint:
    """An opened checkpoint: ``config`` (config.json, or {}), ``tensors`` (name -> TensorInfo, file order).

    Use as a context manager; ``load``/``load_expert`` read one tensor (or one expert's slice) at a time.
    """

    def __init__(self, root: Path, config: dict[str, Any], tensors: dict[str, TensorInfo]):
        self.root = root
        self.config = config
        self.tensors = tensors
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "SourceCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, shard: str) -> Any:
        if shard not in self._handles:
            self._handles[shard] = self._stack.enter_context(_open_shard(self.root / shard))
        return self._handles[shard]

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        try:
            return self._handle(info.shard).get_tensor(name)
        except SafetensorError as e:
            raise ConversionError(f"{self.root / info.shard}: cannot read tensor {name} ({e})") from e

    def load_expert(self, name: str, expert: int) -> torch.Tensor:
        """Row ``expert`` of a stacked ``[E, ...]`` tensor, reading only that slice."""
        info = self.tensors[name]
        try:
            return self._handle(info.shard).get_slice(name)[expert]
        except SafetensorError as e:
            raise ConversionError(f"{self.root / info.shard}: cannot read tensor {name}[{expert}] ({e})") from e


def _open_shard(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ConversionError(f"{path}: cannot read safetensors shard ({e}); the file may be truncated or corrupt") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: cannot read JSON ({e})") from e


def open_checkpoint(root: str | Path) -> SourceCheckpoint:
    """Read config.json (if any), the shard index (or the single ``model.safetensors``) and every header.

    Every header is read up front, so a truncated or missing shard fails before anything is written.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConversionError(f"{root}: not a directory; pass a local HF checkpoint directory")
    config = _read_json(root / "config.json") if (root / "config.json").exists() else {}
    if (root / INDEX_NAME).exists():
        weight_map = _read_json(root / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{root / INDEX_NAME}: no 'weight_map' with tensor names")
        shards = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        weight_map, shards = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in root.iterdir())
        raise ConversionError(
            f"{root}: no {INDEX_NAME} or {SINGLE_NAME} (found {found[:12]}); only safetensors checkpoints are read"
        )
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        path = root / shard
        if not path.exists():
            raise ConversionError(f"{path}: shard listed in {INDEX_NAME} is missing")
        with _open_shard(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = TensorInfo(name, shard, sl.get_dtype(), tuple(sl.get_shape()))
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise ConversionError(f"{root}: {len(missing)} tensors of {INDEX_NAME} are in no shard, e.g. {missing[:3]}")
        tensors = {n: tensors[n] for n in tensors if n in weight_map}
    return SourceCheckpoint(root, config, tensors)
