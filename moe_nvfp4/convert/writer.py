"""Writing a sharded safetensors checkpoint atomically: a temp directory beside DST, renamed at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .source import INDEX_NAME, ConversionError, regular_file

__all__ = ["ShardedWriter", "atomic_output_dir", "copy_non_weight_files", "shard_metadata", "umask_mode", "write_json"]

# Files that hold weights (or their index / the configs we rewrite): never copied from the source.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
REWRITTEN = {INDEX_NAME, "config.json", "hf_quant_config.json"}


@contextmanager
def _sigterm_raises() -> Iterator[list[int]]:
    """SIGTERM raises (as SIGINT does) so the temp directory is removed; the yielded list records the signal
    too, because a handler that fires inside a finalizer has its exception swallowed.  Only the main thread
    can set handlers."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        raise ConversionError("interrupted by SIGTERM; the partial output was removed")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def umask_mode(mode: int) -> int:
    """``mode`` less the process umask: what ``open``/``mkdir`` would have given (safetensors writes 0600 and
    mkdtemp 0700, which a server running as another user could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


@contextmanager
def atomic_output_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``dst``; rename it to ``dst`` on success, delete it on any error,
    SIGINT or SIGTERM.  The directory gets the umask's permissions (mkdtemp's 0700 would hide it from others);
    a write error (a full disk) becomes a ConversionError naming the file."""
    dst = Path(dst)
    if os.path.lexists(dst):
        what = "a dangling symbolic link" if not dst.exists() else "already exists"
        raise ConversionError(f"{dst}: output {what}; remove it or choose another path")
    tmp: Path | None = None
    with _sigterm_raises() as received:
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
            tmp.chmod(umask_mode(0o777))
            yield tmp
            if received:
                raise ConversionError("interrupted by SIGTERM; the partial output was removed")
            tmp.rename(dst)
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConversionError(f"{e.filename or dst}: cannot write ({e.strerror or e}); nothing was written") from e
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def shard_metadata() -> dict[str, str]:
    """Shard header metadata: only ``format`` (transformers requires it).  A second key would make the bytes
    non-deterministic (safetensors writes its metadata map in hash order); our metadata lives in config.json."""
    return {"format": "pt"}


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def copy_non_weight_files(src: Path, dst: Path) -> tuple[list[str], list[str]]:
    """Copy the top-level regular files that hold no weights (tokenizer, generation config, chat template...);
    return (names copied, subdirectories left out).  Subdirectories are never copied: they may hold weights
    or anything else, and the output is a checkpoint, not a copy of the source tree."""
    copied, left_out = [], []
    for path in sorted(src.iterdir()):
        if path.name in REWRITTEN or path.name.startswith(".") or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except OSError:
            is_dir = False  # regular_file names the problem
        if is_dir:
            left_out.append(path.name)
            continue
        if regular_file(path):
            shutil.copyfile(path, dst / path.name)
            copied.append(path.name)
    return copied, left_out


class ShardedWriter:
    """Collects output tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards of about ``max_shard_bytes``.

    Shards are written as they fill (so memory stays bounded) and renamed with the final count in ``close``.
    """

    def __init__(self, out_dir: Path, *, max_shard_bytes: int, metadata: dict[str, str]):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.metadata = metadata
        self.total_bytes = 0
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._file_mode = umask_mode(0o666)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ConversionError(f"output tensor {name} written twice; two source tensors map to the same name")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # A private copy: outputs may share storage (one global scale for gate and up), which safetensors refuses.
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f"shard-{len(self._shards):05d}.tmp"
        try:
            save_file(self._pending, str(path), metadata=self.metadata)
        except SafetensorError as e:  # I/O errors (a full disk) may come back as SafetensorError
            raise OSError(None, str(e), str(path)) from e
        path.chmod(self._file_mode)  # safetensors creates 0600 whatever the umask
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name all shards, write the index; return the shard file names."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        names = []
        weight_map = {}
        for i, tensor_names in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.tmp").rename(self.out_dir / name)
            names.append(name)
            weight_map.update({t: name for t in tensor_names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.out_dir / INDEX_NAME, index)
        return names
