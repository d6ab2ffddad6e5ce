"""The accuracy record from the kernels themselves (issue 58, design 008 decision 3): every zoo layer's MoE forward
through the shipped W4A16 kernel and each W4A8 kernel form, against float64 on the same NVFP4 weights.

    python tools/accuracy_kernels.py --out benchmarks/results/accuracy_kernels     # GPU: accuracy.{json,md}

A layer keeps its H, I, top-k and activation; its experts are capped at ``--experts`` (as tools/accuracy_modes.py,
whose CPU emulation this checks); two inputs: Gaussian rows, and Gaussian rows with 1% of the channels 30x larger.
Each number is ||out - ref|| / ||ref||.  Off a GPU the W4A8 Gluon forms run the Triton kernel (their sums are the
same), so the tool runs under the interpreter too (tests, tiny shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

import torch  # noqa: E402
from accuracy_modes import table, write_record  # noqa: E402

import moe_nvfp4 as m  # noqa: E402
from moe_nvfp4.sm90.w4a8 import Fp8Config, fold_to_fp8, fused_moe_w4a8  # noqa: E402
from moe_nvfp4.zoo import MODELS  # noqa: E402

W4A8_FORMS = {
    "w4a8_triton": Fp8Config(warp_specialized=False),  # the interpreter's stand-in, at the mode's tiles
    "w4a8_gluon": Fp8Config(),  # what the mode runs
}
FORMS = ("w4a16", *W4A8_FORMS)


def layer(experts: int, top_k: int, hidden: int, inter: int, activation, device, gen):
    """Random NVFP4 experts of these sizes (the full FP4 code range in each row's first block) and the checkpoint
    tensors they were packed from."""
    rows13 = (2 if activation.gated else 1) * inter
    w13 = torch.randn(experts, rows13, hidden, generator=gen, device=device) / hidden**0.5
    codes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6], device=device)
    w13[..., :16] = codes / 6
    q13 = m.quantize_nvfp4(w13, segments=2 if activation.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5)
    return q13, q2, m.prepare_moe_weights(q13, q2, activation=activation)


def measure(
    key: str, experts: int, top_k: int, hidden: int, inter: int, activation, tokens: int, dtype, device, seed: int
) -> list[dict]:
    """Both inputs' rows for one layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q13, q2, weights = layer(experts, top_k, hidden, inter, activation, device, gen)
    folded = fold_to_fp8(weights, (q13, q2))
    tw, ti = m.topk_softmax(torch.randn(tokens, experts, generator=gen, device=device), top_k, renormalize=True)
    rows = []
    for inputs in ("gaussian", "outlier_channels"):
        x = torch.randn(tokens, hidden, generator=gen, device=device)
        if inputs == "outlier_channels":
            x[:, torch.randperm(hidden, generator=gen, device=device)[: max(1, hidden // 100)]] *= 30
        x = x.to(dtype)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, activation=activation, compute_dtype=torch.float64)
        outs = {"w4a16": m.fused_moe(x, weights, tw, ti)}
        for form, config in W4A8_FORMS.items():
            outs[form] = fused_moe_w4a8(x, folded, tw, ti, None, config)
        row = dict(
            model=key,
            experts=experts,
            top_k=top_k,
            hidden=hidden,
            intermediate=inter,
            activation=activation.name,
            tokens=tokens,
            inputs=inputs,
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
        )
        for form, out in outs.items():
            row[form] = ((out.double() - ref).norm() / ref.norm()).item()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(z.key for z in MODELS), help="zoo keys, comma separated")
    p.add_argument("--experts", type=int, default=16, help="experts per layer at most (default 16)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for accuracy.json and accuracy.md")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    by_key = {z.key: z for z in MODELS}
    rows = []
    for key in args.models.split(","):
        z = by_key[key]
        e = min(args.experts, z.experts)
        rows += measure(
            key, e, min(z.top_k, e), z.hidden, z.intermediate, z.activation, args.tokens, dtype, device, args.seed
        )
    lines = table(rows, FORMS)
    print("\n".join(lines))
    if args.out is not None:
        command = "python tools/accuracy_kernels.py " + " ".join(sys.argv[1:])
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
        meta = dict(command=command, torch=torch.__version__, device=name, forms=FORMS, doc=__doc__)
        write_record(args.out, f"The kernels against float64, the zoo's layers ({name})", meta, rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
