"""One forward of a model's layer (seeded) with the shipped config; saves the output (for bitwise comparisons
across processes, e.g. with TRITON_KERNEL_OVERRIDE)."""
import sys
import torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from moe_nvfp4 import prepare_moe_weights, topk_softmax
from moe_nvfp4.configs import select_config
from moe_nvfp4.triton import moe_sm90
from tune_moe import MODELS, make_layer
model, tokens, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
e, k, h, i = MODELS[model]
w = prepare_moe_weights(*make_layer(e, h, i, "cuda"))
gen = torch.Generator(device="cuda").manual_seed(tokens)
x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
tw, ti = topk_softmax(torch.randn(tokens, e, device="cuda", generator=gen), k, renormalize=True)
cfg = select_config(tokens, e, k, h, i, x.dtype, torch.cuda.get_device_name())
out = moe_sm90.fused_moe_sm90(x, w.w13_packed, w.w13_scale, w.w13_global, w.w2_packed, w.w2_scale, w.w2_global,
                              tw, ti, None, i, cfg)
torch.cuda.synchronize()
torch.save(out.cpu(), path)
if len(sys.argv) > 4:
    ref = torch.load(sys.argv[4])
    print(model, tokens, "bit-identical" if torch.equal(ref, out.cpu()) else f"DIFFERS max {(ref.float()-out.cpu().float()).abs().max()}")
