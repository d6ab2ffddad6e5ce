"""``moe-nvfp4 tune``: autotune a model's MoE layer shapes on this GPU ahead of serving, into the cache the vLLM
plugin reads at load (design 004, decision 10: tuning left the engine start).

    moe-nvfp4 tune /path/to/checkpoint                 # the shapes config.json gives, up to 8192 tokens
    moe-nvfp4 tune /path/to/checkpoint --tp 4          # what one of 4 tensor-parallel ranks runs
    moe-nvfp4 tune --shape 128,8,2048,768 --ep 8       # one rank of 8 under --enable-expert-parallel

Shapes (``shapes_from_config``): experts, top-k, hidden and expert intermediate size from config.json (or its
``text_config`` / DBRX's ``ffn_config``), the experts' activation from the model type (Nemotron-H: ReLU^2, not
gated; gpt-oss: its clamped SwiGLU with biases), the activation dtype as vLLM's ``--dtype auto`` takes it (float16
stays, anything else runs bfloat16).  A rank's shape is what the plugin keys its cache by: ``--tp N`` slices I,
``--ep N`` keeps E/N local experts of E (vLLM's expert parallelism over TP x DP = N ranks).  The search
(``autotune.tune_layer``) times random NVFP4 weights of that shape (a config's time does not depend on the values)
for at most ``--budget-s`` a shape and writes ``autotune.cache_dir()``; ``vllm serve`` on a GPU of the same model,
with the same package, Triton and torch, then serves those configs without timing anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .expert_activation import ACTIVATION_NAMES, RELU2, SILU, SWIGLU_OAI, ExpertActivation

__all__ = ["TuneShape", "add_tune_parser", "per_rank", "shapes_from_config", "shape_from_flag"]

DEFAULT_MAX_TOKENS = 8192  # vllm serve's --max-num-batched-tokens on a GPU with >= 70 GiB (vLLM 0.26)
SCALE_BLOCK = 16  # NVFP4 scales cover 16 values of K: a TP slice of I keeps whole blocks (as the plugin requires)
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_top_k")
_HIDDEN = ("hidden_size", "d_model")
_INTERMEDIATE = ("moe_intermediate_size", "intermediate_size", "ffn_hidden_size")
_ACTIVATION = {"nemotron_h": RELU2, "gpt_oss": SWIGLU_OAI}  # model_type -> the experts' activation (else SiLU)
_BIASES = ("gpt_oss",)  # model types whose experts have biases on both GEMMs


@dataclass(frozen=True)
class TuneShape:
    """One layer shape to tune, as one GPU runs it (``experts`` local of ``global_experts``, I per rank), its fields
    spelled as ``shapes.LayerShape`` (``layer``) spells them, with the name and biases a tune run reports."""

    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"
    activation: ExpertActivation = SILU
    biases: bool = False
    global_experts: int = 0  # 0: as many as ``experts`` (no expert parallelism)

    @property
    def layer(self):
        """The ``shapes.LayerShape`` the plugin keys the cache by for this rank."""
        from .shapes import LayerShape

        gated = self.activation.gated
        return LayerShape(
            self.experts, self.top_k, self.hidden, self.intermediate, self.dtype, self.global_experts, gated
        )


def _first_int(holder: dict, keys: tuple[str, ...]) -> tuple[str, int] | None:
    for key in keys:
        value = holder.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def _dtype(config: dict, holder: dict, requested: str) -> str:
    if requested != "auto":
        return requested
    named = holder.get("torch_dtype") or holder.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    return "float16" if named == "float16" else "bfloat16"


def shapes_from_config(model_dir: str | Path, *, dtype: str = "auto") -> list[TuneShape]:
    """The routed-expert layer shapes of the model in ``model_dir`` (its config.json), at TP=EP=1; ValueError
    naming what is missing where there is none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no config.json there (give a local checkpoint directory, or --shape E,K,H,I)")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    for holder in (config.get("text_config"), config):
        if not isinstance(holder, dict):
            continue
        merged = {**holder, **(holder.get("ffn_config") if isinstance(holder.get("ffn_config"), dict) else {})}
        experts = _first_int(merged, _EXPERTS)
        if experts is None:
            continue
        found = {
            "top-k": _first_int(merged, _TOP_K),
            "hidden size": _first_int(merged, _HIDDEN),
            "expert intermediate size": _first_int(merged, _INTERMEDIATE),
        }
        missing = [what for what, v in found.items() if v is None]
        if missing:
            raise ValueError(
                f"{path}: {experts[0]}={experts[1]} but no {', '.join(missing)} (looked for "
                f"{_TOP_K}, {_HIDDEN}, {_INTERMEDIATE})"
            )
        model_type = str(holder.get("model_type") or config.get("model_type") or "")
        name = f"{Path(model_dir).name} ({model_type or 'unknown model type'})"
        return [
            TuneShape(
                name,
                experts[1],
                found["top-k"][1],
                found["hidden size"][1],
                found["expert intermediate size"][1],
                _dtype(config, holder, dtype),
                _ACTIVATION.get(model_type, SILU),
                model_type in _BIASES,
            )
        ]
    raise ValueError(f"{path}: no MoE layer (none of {', '.join(_EXPERTS)} in it or its text_config)")


def shape_from_flag(text: str, *, dtype: str = "auto", activation: str = "silu") -> TuneShape:
    """``--shape E,K,H,I`` (as ``moe-nvfp4 demo --shape``); ValueError naming what is out of range."""
    from .bench.moe import parse_shape

    s = parse_shape(text)
    return TuneShape(
        f"--shape {text.replace(' ', '')}",
        s.experts,
        s.top_k,
        s.hidden,
        s.intermediate,
        "bfloat16" if dtype == "auto" else dtype,
        ExpertActivation(activation),
    )


def per_rank(shape: TuneShape, *, tp: int = 1, ep: int = 1) -> TuneShape:
    """What one rank runs under tensor parallelism ``tp`` (I / tp) or expert parallelism ``ep`` (E / ep local of E).
    ValueError where the split is not one vLLM and the plugin load (as the plugin's own refusals say)."""
    if tp < 1 or ep < 1:
        raise ValueError(f"--tp {tp} / --ep {ep}: sizes must be >= 1")
    if tp > 1 and ep > 1:
        raise ValueError("give --tp or --ep, not both (under --enable-expert-parallel vLLM splits experts, not I)")
    if tp > 1:
        i = shape.intermediate // tp
        if shape.intermediate % tp or i % SCALE_BLOCK:
            raise ValueError(
                f"--tp {tp}: the expert intermediate size {shape.intermediate} / {tp} is not a whole "
                f"multiple of {SCALE_BLOCK} (an NVFP4 scale block); vLLM's nvfp4_grouped refuses that split"
            )
        return replace(shape, name=f"{shape.name} TP{tp}", intermediate=i)
    if ep > 1:
        if shape.experts % ep:
            raise ValueError(f"--ep {ep}: {shape.experts} experts do not split evenly over {ep} ranks")
        return replace(shape, name=f"{shape.name} EP{ep}", experts=shape.experts // ep, global_experts=shape.experts)
    return shape


# ---- on the GPU ----
def random_layer(shape: TuneShape, device):
    """(MoEWeights, expert map or None) of ``shape`` on ``device``: random FP4 codes over the whole e2m1 range,
    block scales near 1, a global scale that keeps outputs in bf16's range, zero biases where the model has them;
    under EP the map of the rank holding the first ``experts`` experts."""
    import torch

    from .api import prepare_moe_weights
    from .formats import NVFP4, NVFP4Tensor

    gen = torch.Generator(device).manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    rows = 2 * i if shape.activation.gated else i

    def matrix(n: int, k: int) -> NVFP4Tensor:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        scale = (0.75 + 0.5 * torch.rand(e, n, k // NVFP4.block_size, generator=gen, device=device)).to(
            NVFP4.scale_dtype
        )
        return NVFP4Tensor(packed, scale, torch.full((e,), 0.3 / k**0.5, device=device))

    biases = (
        dict(w13_bias=torch.zeros(e, rows, device=device), w2_bias=torch.zeros(e, h, device=device))
        if shape.biases
        else {}
    )
    weights = prepare_moe_weights(matrix(rows, h), matrix(h, i), activation=shape.activation, **biases)
    expert_map = None
    if shape.global_experts and shape.global_experts != e:
        expert_map = torch.full((shape.global_experts,), -1, dtype=torch.int32, device=device)
        expert_map[:e] = torch.arange(e, dtype=torch.int32, device=device)
    return weights, expert_map


def gpu_measure(shape: TuneShape, stack):
    """(device traits, measure) for ``shape`` on the current GPU; ``stack`` (an ExitStack) frees its buffers."""
    import torch

    from .shapes import device_traits
    from .sm90.autotune import gpu_timer

    device = torch.device("cuda", torch.cuda.current_device())
    weights, expert_map = random_layer(shape, device)
    dtype = getattr(torch, shape.dtype)
    return device_traits(device), stack.enter_context(gpu_timer(weights, shape.top_k, dtype, expert_map))


def tune_one(shape: TuneShape, args: argparse.Namespace):
    """Tune ``shape`` with a progress bar (stderr) over the budget's seconds; returns the AutotuneReport."""
    import contextlib

    from tqdm import tqdm

    from .sm90.autotune import tune_layer

    with contextlib.ExitStack() as stack:
        traits, measure = gpu_measure(shape, stack)
        bar = stack.enter_context(
            tqdm(
                total=round(args.budget_s),
                desc=shape.name,
                disable=args.quiet,
                bar_format="{desc}: {bar} {n:.0f} of {total} s{postfix}",
            )
        )
        began = time.monotonic()

        def timed(cfg, tokens: int) -> float | None:
            us = measure(cfg, tokens)
            bar.update(min(bar.total, time.monotonic() - began) - bar.n)
            bar.set_postfix_str(f"T={tokens}: " + ("failed" if us is None else f"{us:.1f} us"), refresh=False)
            return us

        return tune_layer(shape.layer, traits, args.max_tokens, timed, budget_s=args.budget_s, force=args.force)


def summary(report) -> str:
    """The report's line and, where it timed, one row per bucket: the time of the config served before, and what
    replaced it."""
    lines = [report.summary()]
    for b in report.buckets:
        if b.start_us is None:
            row = "not timed (the budget ran out first)" if b.timed == 0 else "failed to run: the default stays"
        elif b.config == b.start:
            row = f"{b.start_us:.1f} us, kept"
        else:
            row = f"{b.start_us:.1f} -> {b.us:.1f} us ({b.config.to_dict()})"
        lines.append(f"  T <= {b.tokens}: {row}")
    return "\n".join(lines)


def _check_gpu() -> None:
    """ValueError unless torch sees a GPU of an architecture the fused MoE has run on (bench.device)."""
    import torch

    from .bench.device import verified_archs

    if not torch.cuda.is_available():
        raise ValueError(
            f"tuning times the kernels on the GPU you serve with, and torch {torch.__version__} sees no "
            "CUDA GPU here (--dry-run lists the shapes without one)"
        )
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    if arch not in verified_archs():
        raise ValueError(
            f"{torch.cuda.get_device_name()} is {arch}; the kernels tuned here run on {', '.join(verified_archs())}"
        )


def _fail(message: str) -> int:
    print(f"moe-nvfp4 tune: error: {message}", file=sys.stderr)
    return 2


def _shapes(args: argparse.Namespace) -> list[TuneShape]:
    if (args.model_dir is None) == (args.shape is None):
        raise ValueError("give a model directory or --shape E,K,H,I (one of them)")
    if args.activation != "silu" and args.shape is None:
        raise ValueError("--activation is for --shape; a model directory's config says its activation")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    if not args.budget_s > 0:
        raise ValueError(f"--budget-s {args.budget_s}: must be > 0")
    found = (
        [shape_from_flag(args.shape, dtype=args.dtype, activation=args.activation)]
        if args.shape
        else shapes_from_config(args.model_dir, dtype=args.dtype)
    )
    return [per_rank(s, tp=args.tp, ep=args.ep) for s in found]


def run(args: argparse.Namespace) -> int:
    from .sm90.autotune import cache_dir

    try:
        shapes = _shapes(args)
        if not args.dry_run:
            _check_gpu()
    except ValueError as e:
        return _fail(str(e))
    for s in shapes:
        print(
            f"{s.name}: E={s.experts}"
            + (f" of {s.global_experts}" if s.global_experts else "")
            + f" top-{s.top_k} H={s.hidden} I={s.intermediate} {s.dtype} {s.activation.name}"
            + (" with biases" if s.biases else "")
            + f", up to {args.max_tokens} tokens"
        )
    if args.dry_run:
        print(f"cache: {cache_dir()} (nothing timed: --dry-run)")
        return 0
    reports = [tune_one(s, args) for s in shapes]
    print("\n".join(summary(r) for r in reports))
    print(
        f"cache: {cache_dir()}; the next `vllm serve --quantization nvfp4_grouped` on this GPU reads it "
        "(same moe_nvfp4, Triton and torch; MOE_NVFP4_CACHE_DIR moves it)"
    )
    return 0


def add_tune_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from .sm90.autotune import DEFAULT_BUDGET_S

    p = sub.add_parser(
        "tune",
        help="autotune a model's MoE layers on this GPU into the cache vLLM's nvfp4_grouped reads at load",
        description="Times the kernel configs around the default for each token bucket of each MoE layer shape of "
        "MODEL_DIR (its config.json) or --shape, and writes the fastest to the autotune cache "
        "(~/.cache/moe_nvfp4/autotune, or MOE_NVFP4_CACHE_DIR). vllm serve then uses them without tuning at start. "
        "Run it on the GPU model and software versions you serve with; under TP or EP give the same --tp / --ep.",
        epilog="exit status: 0 tuned (or already cached); 2 bad arguments or no usable GPU",
    )
    p.add_argument(
        "model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="local checkpoint directory (config.json)"
    )
    p.add_argument(
        "--shape", default=None, metavar="E,K,H,I", help="experts, top-k, hidden, intermediate of one layer instead"
    )
    p.add_argument(
        "--activation",
        default="silu",
        choices=ACTIVATION_NAMES,
        help="with --shape: the experts' activation (relu2: not gated)",
    )
    ranks = p.add_mutually_exclusive_group()
    ranks.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size: tune one rank's slice of I"
    )
    ranks.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert-parallel size (TP x DP with --enable-expert-parallel): E/N local experts",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="T",
        help=f"tokens per forward to tune up to: vLLM's --max-num-batched-tokens times the data-parallel size "
        f"(default {DEFAULT_MAX_TOKENS}, vllm serve's on a >= 70 GiB GPU)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16"),
        help="activation dtype (auto: as vLLM's --dtype auto)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="S",
        help=f"search time per shape, compiles included (default {DEFAULT_BUDGET_S:g})",
    )
    p.add_argument("--force", action="store_true", help="time again what the cache already holds, and overwrite it")
    p.add_argument(
        "--dry-run", action="store_true", help="print the shapes and the cache directory; time nothing (no GPU needed)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
