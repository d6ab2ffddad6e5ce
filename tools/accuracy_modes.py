"""How far each activation precision lands from the exact answer, on every zoo model's MoE layer (CPU, torch).

    python tools/accuracy_modes.py --out benchmarks/results/accuracy_modes      # accuracy.{json,md}

The NVFP4 weights are exact in every mode (their products with the block and global scales are applied outside the
MMA, or, for ``w4a8_folded``, folded into the FP8 weight with one rounding); what differs is what the activations
entering each GEMM are rounded to:

* ``w4a16``      the shipped kernel: x as given (bf16), GEMM1's activation rows rounded to bf16, each (token, k) row
                 of GEMM2 rounded to bf16 before the fixed-order sum, the output rounded to bf16;
* ``w4a8``       an FP8 tensor-core mode: x and GEMM1's activation rows quantized per row to e4m3 (scale amax/448),
                 products with the exact weights (each 16-element block's scale applied to its partial sums);
* ``w4a8_folded`` the same activations, each weight code times its block scale rounded to e4m3 (one power of two per
                 expert and matrix keeps the largest in range), so one FP8 MMA runs whole K;
* ``w4a4``       NVFP4 activations (per-16 e4m3 scales, one global scale from the tensor's amax, the best a
                 calibrated ModelOpt input scale can be), what W4A4 checkpoints run.

Each number is ||out - ref|| / ||ref|| against float64 on the same weights and the same bf16 x.  A layer keeps its
H, I, top-k and activation; its experts are capped at ``--experts`` (the error of one expert's GEMMs does not depend
on how many others there are), and two inputs are drawn: Gaussian rows, and Gaussian rows with 1% of the channels 30x
larger (the outlier channels of real hidden states).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

import torch  # noqa: E402

from moe_nvfp4 import formats  # noqa: E402
from moe_nvfp4.reference import fake_quantize_activations  # noqa: E402
from moe_nvfp4.zoo import MODELS  # noqa: E402

MODES = ("w4a16", "w4a8", "w4a8_folded", "w4a4")
E4M3_MAX = 448.0


def e4m3_per_row(a: torch.Tensor) -> torch.Tensor:
    """Rows quantized to e4m3 with one float32 scale each (amax / 448), back in float64: an FP8 MMA's input."""
    scale = (a.abs().amax(-1, keepdim=True).float() / E4M3_MAX).clamp_min(1e-30)
    return (a.float() / scale).to(torch.float8_e4m3fn).double() * scale.double()


def folded_fp8(q: formats.NVFP4Tensor) -> torch.Tensor:
    """Weights as one e4m3 tensor per expert and matrix, times a power of two: code x block scale rounded to e4m3
    (at most 4 significant bits of the up to 5 the product has), the global scale applied after (float64)."""
    codes = formats.decode_e2m1(formats.unpack_fp4(q.packed)).float()
    product = codes * q.block_scale.float().repeat_interleave(16, dim=-1)[..., : codes.shape[-1]]  # exact in fp32
    del codes
    shift = torch.exp2(torch.ceil(torch.log2(product.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX)).clamp_min(0))
    dense = formats.dequantize_nvfp4(q, torch.float64)  # product times each row's global scale, exactly
    global_row = dense.abs().sum(-1, keepdim=True) / product.abs().sum(-1, keepdim=True).double().clamp_min(1e-300)
    del dense
    return (product / shift).to(torch.float8_e4m3fn).double() * shift.double() * global_row


def expert_weights(model, gen: torch.Generator) -> tuple[formats.NVFP4Tensor, formats.NVFP4Tensor]:
    """One random NVFP4 expert of ``model``'s H, I and activation (w13 [1, (2)I, H], w2 [1, H, I])."""
    gate_up = 2 if model.activation.gated else 1
    w13 = torch.randn(1, gate_up * model.intermediate, model.hidden, generator=gen) / model.hidden**0.5
    w2 = torch.randn(1, model.hidden, model.intermediate, generator=gen) / model.intermediate**0.5
    return formats.quantize_nvfp4(w13, segments=gate_up), formats.quantize_nvfp4(w2)


def expert_rows(xe: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation, mode: str) -> torch.Tensor:
    """One expert's output rows in float64 for its (token, k) rows ``xe`` (bf16 values), with the activations each
    GEMM reads rounded as ``mode`` says (module doc; "exact": none), before the routing weight."""
    xe = xe.double()
    if mode in ("w4a8", "w4a8_folded"):
        xe = e4m3_per_row(xe)
    elif mode == "w4a4":
        xe = fake_quantize_activations(xe, formats.global_scale_for(xe)).double()
    act = activation.torch_twin(xe @ w13.T)
    if mode == "w4a16":
        act = act.to(torch.bfloat16).double()
    elif mode in ("w4a8", "w4a8_folded"):
        act = e4m3_per_row(act)
    elif mode == "w4a4":
        act = fake_quantize_activations(act, formats.global_scale_for(act)).double()
    return act @ w2.T


def measure(model, experts: int, tokens: int, seed: int) -> list[dict]:
    """Both inputs' rows of the table for ``model``: the layer built one expert at a time (a Mixtral expert's
    float64 copies alone are gigabytes)."""
    gen = torch.Generator().manual_seed(seed)
    e = min(experts, model.experts)
    k = min(model.top_k, e)
    tw, ti = torch.softmax(torch.randn(tokens, e, generator=gen), -1).topk(k, -1)
    tw = (tw / tw.sum(-1, keepdim=True)).double()
    xs = {}
    for inputs in ("gaussian", "outlier_channels"):
        x = torch.randn(tokens, model.hidden, generator=gen)
        if inputs == "outlier_channels":
            x[:, torch.randperm(model.hidden, generator=gen)[: max(1, model.hidden // 100)]] *= 30
        xs[inputs] = x.bfloat16()
    outs = {(i, m): torch.zeros(tokens, model.hidden, dtype=torch.float64) for i in xs for m in ("exact", *MODES)}
    for expert in range(e):
        q13, q2 = expert_weights(model, gen)
        token, slot = torch.nonzero(ti == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        exact = (formats.dequantize_nvfp4(q13, torch.float64)[0], formats.dequantize_nvfp4(q2, torch.float64)[0])
        folded = (folded_fp8(q13)[0], folded_fp8(q2)[0])
        for inputs, x in xs.items():
            for mode in ("exact", *MODES):
                y = expert_rows(x[token], *(folded if mode == "w4a8_folded" else exact), model.activation, mode)
                y = y * tw[token, slot][:, None]
                if mode == "w4a16":  # GEMM2's (token, k) rows in bf16, as the kernel writes them for the combine
                    y = y.to(torch.bfloat16).double()
                outs[inputs, mode].index_add_(0, token, y)
        del exact, folded
    rows = []
    for inputs in xs:
        ref = outs[inputs, "exact"]
        row = dict(
            model=model.key,
            experts=e,
            top_k=k,
            hidden=model.hidden,
            intermediate=model.intermediate,
            activation=model.activation.name,
            tokens=tokens,
            inputs=inputs,
            seed=seed,
        )
        for mode in MODES:
            out = outs[inputs, mode].to(torch.bfloat16).double() if mode == "w4a16" else outs[inputs, mode]
            row[mode] = ((out - ref).norm() / ref.norm()).item()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], columns: Sequence[str] = MODES) -> list[str]:
    """The record's Markdown table: a row per layer and input, a column per precision (``columns``)."""
    lines = [
        "| model (H, I, top-k, activation) | inputs | " + " | ".join(columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    for r in rows:
        shape = f"{r['model']} ({r['hidden']}, {r['intermediate']}, {r['top_k']}, {r['activation']})"
        lines.append(f"| {shape} | {r['inputs']} | " + " | ".join(f"{r[m]:.2e}" for m in columns) + " |")
    return lines


def write_record(out: Path, title: str, meta: dict, rows: list[dict], lines: list[str]) -> None:
    """out/accuracy.json (meta and rows) and out/accuracy.md (``title``, the command, the table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    (out / "accuracy.md").write_text(
        f"# {title}\n\n"
        f"- command: `{meta['command']}`; torch {meta['torch']}; ||out - ref|| / ||ref||, same NVFP4 weights\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(m.key for m in MODELS), help="zoo keys, comma separated")
    p.add_argument("--experts", type=int, default=8, help="experts per layer at most (default 8)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for accuracy.json and accuracy.md")
    args = p.parse_args()
    by_key = {m.key: m for m in MODELS}
    rows = [r for key in args.models.split(",") for r in measure(by_key[key], args.experts, args.tokens, args.seed)]
    lines = table(rows)
    print("\n".join(lines))
    if args.out is not None:
        command = "python tools/accuracy_modes.py " + " ".join(sys.argv[1:])
        meta = dict(command=command, torch=torch.__version__, device="cpu", modes=MODES, doc=__doc__)
        write_record(args.out, "Activation precision against float64, the zoo's layers (CPU)", meta, rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
