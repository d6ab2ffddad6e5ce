"""Writing a sharded safetensors checkpoint atomically: a temp directory beside DST, renamed at the end."""
from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from .source import INDEX_NAME, ConversionError

__all__ = ["ShardedWriter", "atomic_output_dir", "copy_non_weight_files", "write_json"]

# Files that hold weights (or their index / the configs we rewrite): never copied from the source.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
REWRITTEN = {INDEX_NAME, "config.json", "hf_quant_config.json"}


@contextmanager
def atomic_output_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``dst``; rename it to ``dst`` on success, delete it on any error."""
    dst = Path(dst)
    if dst.exists():
        raise ConversionError(f"{dst}: output already exists; remove it or choose another path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def copy_non_weight_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and every other non-weight file; return the names copied."""
    copied = []
    for path in sorted(src.iterdir()):
        if path.name in REWRITTEN or path.name.startswith(".") or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.is_dir():
            shutil.copytree(path, dst / path.name)
        else:
            shutil.copy2(path, dst / path.name)
        copied.append(path.name)
    return copied


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
        save_file(self._pending, str(self.out_dir / f"shard-{len(self._shards):05d}.tmp"), metadata=self.metadata)
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
