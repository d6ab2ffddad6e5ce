"""Probe: FragmentLayout blocks stored chunk-major (block (u, c) at c * units + u) instead of unit-major
(u * chunks + c), read by the same Gluon kernels through TMA descriptors with swapped strides.  Concurrent
programs (different units, the same K chunk) then read adjacent 4 KiB blocks, as a plain streaming read does."""
import json, statistics, sys
import torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from harness import time_graph
from moe_nvfp4 import prepare_moe_weights, topk_softmax
from moe_nvfp4.configs import select_config
from moe_nvfp4.layouts import FragmentLayout
from moe_nvfp4.triton import moe_sm90, moe_sm90_ws as W
from tune_moe import MODELS, make_layer, rotated_weights

F = FragmentLayout()
unit_major = W._descriptors


def chunk_major(t: torch.Tensor, kp: int, block: int) -> torch.Tensor:
    chunks_k = kp // 128
    n_units = t.numel() // (chunks_k * block)
    return t.reshape(n_units, chunks_k, block).transpose(0, 1).contiguous().reshape(t.shape)


def chunk_major_descriptors(w_packed, w_scale, kp, units, chunks):
    chunks_k = kp // 128
    n_units = w_packed.numel() // (chunks_k * F.block_bytes)

    def view(t, block, layout):
        rows = block // 128
        return W.TensorDescriptor(t.reshape(-1), [chunks_k, n_units, rows, 128], [n_units * block, block, 128, 1],
                                  [chunks, units, rows, 128], layout)
    return view(w_packed, F.block_bytes, W._W_BOX), view(w_scale, F.scale_block_bytes, W._S_BOX)


def permuted(ws):
    w13, s13, g13, w2, s2, g2 = ws
    k1, k2 = w13.shape[-1] * 2, w2.shape[-1] * 2
    return (chunk_major(w13, k1, F.block_bytes), chunk_major(s13, k1, F.scale_block_bytes), g13,
            chunk_major(w2, k2, F.block_bytes), chunk_major(s2, k2, F.scale_block_bytes), g2)


for case in sys.argv[1].split(","):
    model, tokens = case.split(":"); tokens = int(tokens)
    e, k, h, i = MODELS[model]
    cfg = select_config(tokens, e, k, h, i, torch.bfloat16, torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ti = topk_softmax(torch.randn(tokens, e, device="cuda", generator=gen), k, renormalize=True)
    w = prepare_moe_weights(*make_layer(e, h, i, "cuda"))
    std = rotated_weights((w.w13_packed, w.w13_scale, w.w13_global, w.w2_packed, w.w2_scale, w.w2_global), ti)
    cm = [permuted(ws) for ws in std]
    variants = {"unit_major": (unit_major, std), "chunk_major": (chunk_major_descriptors, cm)}
    outs, times = {}, {v: [] for v in variants}
    try:
        for v, (desc, copies) in variants.items():
            W._descriptors = desc
            outs[v] = moe_sm90.fused_moe_sm90(x, *copies[0], tw, ti, None, i, cfg)
        same = torch.equal(outs["unit_major"], outs["chunk_major"])
        for _ in range(int(sys.argv[2])):
            for v, (desc, copies) in variants.items():
                W._descriptors = desc
                fns = [lambda ws=ws: moe_sm90.fused_moe_sm90(x, *ws, tw, ti, None, i, cfg) for ws in copies]
                times[v].append(time_graph(fns).median_us)
    finally:
        W._descriptors = unit_major
    print(json.dumps(dict(case=case, same_bits=same, copies=len(std),
                          **{v: dict(median=statistics.median(t), lo=min(t), hi=max(t)) for v, t in times.items()})),
          flush=True)
    del std, cm, w
    torch.cuda.empty_cache()
