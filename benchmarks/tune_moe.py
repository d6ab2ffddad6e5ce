"""Tune the sm_90 fused MoE kernel's configs on the GPU and write configs/fused_moe_sm90/<device>.json.

    python benchmarks/tune_moe.py                      # Mixtral + Qwen3-30B-A3B shapes, bf16, all token counts
    python benchmarks/tune_moe.py --probe              # time the default heuristic only (no tuning)

For each (model, tokens) every candidate is checked against the torch reference first, then timed by
CUDA-graph replay (triton.testing.do_bench_cudagraph, median); the fastest valid one is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_nvfp4 import fused_moe_torch, prepare_moe_weights, quantize_nvfp4, topk_softmax  # noqa: E402
from moe_nvfp4.configs import CONFIG_VERSION, KERNEL_NAME, GemmConfig, MoEKernelConfig, config_path, default_config  # noqa: E402
from moe_nvfp4.triton.moe_sm90 import fused_moe_sm90  # noqa: E402

MODELS = {  # name: (experts, top_k, hidden, intermediate)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


def make_layer(experts: int, hidden: int, inter: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device, generator=gen) / inter**0.5
    q13, q2 = quantize_nvfp4(w13, segments=2), quantize_nvfp4(w2)
    del w13, w2
    return q13, q2


def candidates(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> list[MoEKernelConfig]:
    base = default_config(tokens, experts, top_k, hidden, inter)
    rows = max(1, tokens * top_k // experts)
    block_ms = [16] if rows <= 8 else [16, 32] if rows <= 24 else [32, 64] if rows <= 96 else [64, 128]
    out = {base}
    splits = (1, 2, 4) if rows <= 16 else (1,)  # decode: too few tiles to fill the GPU without a K split
    for bm, bn, warps, stages, per_sm, split1, split2 in itertools.product(
        block_ms, (64, 128), (4, 8), (3, 4), (1, 2), splits, splits
    ):
        gemm1 = GemmConfig(block_n=bn, num_warps=warps, num_stages=stages, programs_per_sm=per_sm, split_k=split1)
        cfg = MoEKernelConfig(block_m=bm, gemm1=gemm1, gemm2=dataclasses.replace(gemm1, split_k=split2))
        if cfg.is_valid(-(-hidden // 128) * 128, -(-inter // 128) * 128):
            out.add(cfg)
    return sorted(out, key=lambda c: json.dumps(c.to_dict(), sort_keys=True))


def spread(cands: list[MoEKernelConfig], limit: int, first: MoEKernelConfig) -> list[MoEKernelConfig]:
    """At most ``limit`` configs: ``first``, then evenly spaced picks from each (GEMM1, GEMM2) K-split pair,
    taken in turn, so every split combination is timed however small the limit."""
    groups: dict[tuple[int, int], list[MoEKernelConfig]] = {}
    for c in cands:
        if c != first:
            groups.setdefault((c.gemm1.split_k, c.gemm2.split_k), []).append(c)
    per_group = -(-(limit - 1) // max(1, len(groups)))
    counts = [min(per_group, len(g)) for g in groups.values()]
    picks = [[g[i * len(g) // n] for i in range(n)] for g, n in zip(groups.values(), counts)]
    in_turn = [c for row in itertools.zip_longest(*picks) for c in row if c is not None]
    return [first] + in_turn[: limit - 1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1,16,64,256,1024,4096")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--probe", action="store_true", help="time the default heuristic only")
    p.add_argument("--max-candidates", type=int, default=24)
    p.add_argument("--out", default=None, help="JSON to write (default: configs/fused_moe_sm90/<device>.json)")
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph

    dev = "cuda"
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    entries, lines = [], []
    for model in args.models.split(","):
        e, k, h, i = MODELS[model]
        q13, q2 = make_layer(e, h, i, dev)
        weights = prepare_moe_weights(q13, q2)
        w = (weights.w13_packed, weights.w13_scale, weights.w13_global, weights.w2_packed, weights.w2_scale,
             weights.w2_global)  # fmt: skip
        for t in [int(s) for s in args.tokens.split(",")]:
            x = torch.randn(t, h, device=dev, dtype=dtype)
            tw, ti = topk_softmax(torch.randn(t, e, device=dev), k, renormalize=True)
            ref = fused_moe_torch(x[:64], q13, q2, tw[:64], ti[:64]).float()
            if args.probe:
                cands = [default_config(t, e, k, h, i)]
            else:
                cands = spread(candidates(t, e, k, h, i), args.max_candidates, default_config(t, e, k, h, i))
            best = None
            for cfg in cands:
                try:
                    out = fused_moe_sm90(x, *w, tw, ti, None, i, cfg)
                    err = ((out[:64].float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print(f"  {model} T={t} {cfg}: rel err {err:.3g} -- rejected", flush=True)
                        continue
                    us = 1e3 * do_bench_cudagraph(lambda: fused_moe_sm90(x, *w, tw, ti, None, i, cfg), rep=50)
                except Exception as exc:  # a config that fails to compile is skipped, not fatal
                    print(f"  {model} T={t} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            if best is None:
                lines.append(f"{model:>14} T={t:>5}: no valid config")
                continue
            us, cfg, err = best
            lines.append(f"{model:>14} T={t:>5}: {us:9.1f} us  err {err:.2e}  {cfg}")
            print(lines[-1], flush=True)
            entries.append(dict(experts=e, hidden=h, intermediate=i, dtype=args.dtype, max_tokens=t,
                                config=cfg.to_dict(), time_us=round(us, 2)))  # fmt: skip
        del weights, q13, q2
        torch.cuda.empty_cache()
    if not args.probe:
        out_path = Path(args.out) if args.out else config_path(name)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(kernel=KERNEL_NAME, version=CONFIG_VERSION, device=name, torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))  # fmt: skip
        out_path.write_text(json.dumps({"meta": meta, "entries": entries}, indent=1) + "\n")
        print(f"wrote {out_path}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
