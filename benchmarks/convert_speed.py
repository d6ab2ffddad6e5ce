"""Conversion speed: GB of BF16 expert weights quantized per second by ``moe-nvfp4 convert``.

Builds a synthetic Qwen3-MoE-shaped checkpoint (random BF16 experts with std 0.02, per-expert names, sharded)
and times ``convert_checkpoint`` on it.  Repro:

    python benchmarks/convert_speed.py --layers 2 --experts 64 --hidden 2048 --intermediate 768 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_nvfp4.convert import ConvertOptions, convert_checkpoint


def build(root: Path, *, layers: int, experts: int, hidden: int, intermediate: int, shard_bytes: int) -> int:
    """Write the synthetic checkpoint; return its expert bytes."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "hidden_size": hidden, "num_experts": experts})
    )
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, shard_size, shards, total = {}, {}, 0, [], 0

    def flush() -> None:
        nonlocal shard, shard_size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shards.append(name)
        shard, shard_size = {}, 0

    for layer in range(layers):
        for e in range(experts):
            for proj, shape in (
                ("gate_proj", (intermediate, hidden)),
                ("up_proj", (intermediate, hidden)),
                ("down_proj", (hidden, intermediate)),
            ):
                t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                shard[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = t
                shard_size += t.numel() * 2
                total += t.numel() * 2
            if shard_size >= shard_bytes:
                flush()
    if shard:
        flush()
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workdir", default=None, help="where to put the checkpoints (default: a temp dir, deleted after)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert_speed-"))
    try:
        size = build(
            work / "src",
            layers=args.layers,
            experts=args.experts,
            hidden=args.hidden,
            intermediate=args.intermediate,
            shard_bytes=500 * 10**6,
        )
        summary = convert_checkpoint(work / "src", work / "dst", ConvertOptions(device=args.device), progress=False)
        print(summary)
        print(
            f"convert_speed: {size / 1e9:.3f} GB bf16 experts in {summary.seconds:.1f} s = {summary.gb_per_second:.3f} GB/s "
            f"(device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
