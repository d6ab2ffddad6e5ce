"""Reading a local HF checkpoint directory tensor by tensor (safetensors, memory-mapped, never whole)."""

from __future__ import annotations

import json
import os
import stat
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["ConversionError", "SourceCheckpoint", "TensorInfo", "open_checkpoint", "regular_file", "DTYPE_BYTES"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# What reading a shard can raise besides SafetensorError (a header the library accepts but torch cannot map);
# MemoryError: safetensors maps the whole shard, which a memory limit (ulimit -v) on a huge shard refuses.
_READ_ERRORS = (SafetensorError, OSError, RuntimeError, TypeError, ValueError, OverflowError, MemoryError)
# safetensors' own bound on the JSON header; a larger length field is a corrupt file, not a header to read.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype string -> bytes per element
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


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
        handle = self._handle(info.shard)  # its own ConversionError names the shard
        try:
            return handle.get_tensor(name)
        except _READ_ERRORS as e:
            raise ConversionError(f"{self.root / info.shard}: cannot read tensor {name} {_what(info, e)}") from e

    def load_expert(self, name: str, expert: int) -> torch.Tensor:
        """Row ``expert`` of a stacked ``[E, ...]`` tensor, reading only that slice."""
        info = self.tensors[name]
        handle = self._handle(info.shard)
        try:
            return handle.get_slice(name)[expert]
        except _READ_ERRORS as e:
            raise ConversionError(
                f"{self.root / info.shard}: cannot read tensor {name}[{expert}] {_what(info, e)}"
            ) from e


def _what(info: TensorInfo, e: BaseException) -> str:
    """Why a read failed, in words: a memory limit is named as one (a MemoryError prints as 'Cannot allocate')."""
    if isinstance(e, MemoryError):
        return (
            f"({info.nbytes / 1e9:.3g} GB, shape {list(info.shape)}): out of memory mapping or reading it ({e}); "
            "a memory limit (ulimit -v, a container) smaller than the shard?"
        )
    return f"({e})"


def regular_file(path: Path) -> bool:
    """Whether ``path`` exists as a regular file (symlinks followed); ConversionError for anything else there.

    Only regular files are ever opened: a FIFO would block forever, a symlink loop or a device fails oddly.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise ConversionError(f"{path}: dangling symbolic link") from None
        return False
    except OSError as e:
        raise ConversionError(f"{path}: cannot stat ({e.strerror}); a symlink loop?") from e
    if not stat.S_ISREG(mode):
        raise ConversionError(
            f"{path}: not a regular file (a directory, FIFO, socket or device); only regular files are read"
        )
    return True


def _open_shard(path: Path) -> Any:
    if not regular_file(path):
        raise ConversionError(f"{path}: shard is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except MemoryError as e:
        raise ConversionError(
            f"{path}: cannot map the shard ({path.stat().st_size / 1e9:.3g} GB) into memory ({e}); "
            "a memory limit (ulimit -v, a container) smaller than the shard?"
        ) from e
    except _READ_ERRORS as e:
        raise ConversionError(
            f"{path}: cannot read safetensors shard ({e}); the file may be truncated or corrupt"
        ) from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _weight_map(path: Path) -> dict[str, str]:
    weight_map = _read_json(path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{path}: no 'weight_map' with tensor names")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or not v or "/" in v or v.startswith(".")]
    if bad:
        raise ConversionError(f"{path}: weight_map entry {bad[0]!r} -> {weight_map[bad[0]]!r} is not a shard file name")
    return weight_map


def _header_entries(path: Path) -> list[TensorInfo]:
    """A shard's tensors from its JSON header alone: 8 bytes of length, then the header, read with plain reads.

    Nothing is mapped (safetensors maps the whole file, which a memory limit refuses for a huge shard), so
    opening a checkpoint costs its headers' bytes, whatever its size.  The checks are safetensors' own: shapes
    of non-negative integers, each tensor's byte range its dtype and shape, ranges tiling the data exactly (a
    truncated file fails here, before anything is written).
    """

    def bad(why: str) -> ConversionError:
        return ConversionError(f"{path}: cannot read safetensors header ({why}); the file may be truncated or corrupt")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise bad(f"header length {length} past the file's {size} bytes or safetensors' {MAX_HEADER_BYTES}")
            text = f.read(length)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    infos, ranges = [], []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise bad(f"{name}: entry is {type(entry).__name__}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or not dtype:
            raise bad(f"{name}: dtype {dtype!r} is not a dtype name")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{name}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            raise bad(f"{name}: data_offsets {offsets!r} is not [start, end]")
        info = TensorInfo(name, path.name, dtype, tuple(shape))
        if dtype in DTYPE_BYTES and offsets[1] - offsets[0] != info.nbytes:  # others (F4, E8M0): safetensors checks
            raise bad(
                f"{name}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, {dtype} {shape} needs {info.nbytes}"
            )
        infos.append(info)
        ranges.append(offsets)
    end = 0
    for start, stop in sorted(ranges):
        if start != end:
            raise bad(f"tensor data ranges overlap or leave a gap at byte {min(start, end)}")
        end = stop
    if end != size - 8 - length:
        raise bad(f"the tensors hold {end} bytes of data, the file {size - 8 - length}")
    return infos


def _headers(root: Path, shards: list[str]) -> dict[str, TensorInfo]:
    """Every tensor of every shard; a name in two shards is refused (which copy is meant is ambiguous)."""
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        path = root / shard
        if not regular_file(path):
            raise ConversionError(f"{path}: shard is missing")
        for info in _header_entries(path):
            if info.name in tensors:
                raise ConversionError(
                    f"{info.name}: in two shards, {tensors[info.name].shard} and {shard}; remove the stale copy"
                )
            tensors[info.name] = info
    return tensors


def open_checkpoint(root: str | Path) -> SourceCheckpoint:
    """Read config.json (if any), the shard index (or the single ``model.safetensors``) and every header.

    Every header is read up front, so a truncated or missing shard fails before anything is written.  With
    an index, each tensor must be in the shard the index names, and in no other.
    """
    root = Path(root)
    try:
        is_dir = stat.S_ISDIR(os.stat(root).st_mode)
    except OSError as e:
        raise ConversionError(f"{root}: cannot read ({e.strerror}); pass a local HF checkpoint directory") from e
    if not is_dir:
        raise ConversionError(f"{root}: not a directory; pass a local HF checkpoint directory")
    config = _read_json(root / "config.json") if regular_file(root / "config.json") else {}
    if regular_file(root / INDEX_NAME):
        weight_map: dict[str, str] | None = _weight_map(root / INDEX_NAME)
        shards = sorted(set(weight_map.values()))
    elif regular_file(root / SINGLE_NAME):
        weight_map, shards = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in root.iterdir())
        raise ConversionError(
            f"{root}: no {INDEX_NAME} or {SINGLE_NAME} (found {found[:12]}); only safetensors checkpoints are read"
        )
    for shard in shards:
        if not regular_file(root / shard):
            raise ConversionError(f"{root / shard}: shard listed in {INDEX_NAME} is missing")
    tensors = _headers(root, shards)
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise ConversionError(f"{root}: {len(missing)} tensors of {INDEX_NAME} are in no shard, e.g. {missing[:3]}")
        moved = [n for n, shard in weight_map.items() if tensors[n].shard != shard]
        if moved:
            n = moved[0]
            raise ConversionError(f"{n}: {INDEX_NAME} names shard {weight_map[n]}, but it is in {tensors[n].shard}")
        tensors = {n: tensors[n] for n in tensors if n in weight_map}
    return SourceCheckpoint(root, config, tensors)
