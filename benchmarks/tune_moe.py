"""Tune the sm_90 fused MoE kernel's configs on the GPU and write configs/fused_moe_sm90/<device>.json.

    python benchmarks/tune_moe.py                      # Mixtral + Qwen3-30B-A3B shapes, bf16, all token counts
    python benchmarks/tune_moe.py --probe              # time the default heuristic only (no tuning)

    python benchmarks/tune_moe.py --tokens 1,16 --max-candidates 48 --update   # re-tune decode, keep the rest
    python benchmarks/tune_moe.py --update --climb --max-candidates 8          # climb from the shipped configs

    python benchmarks/tune_moe.py --update --climb --sweep --jobs 14 --max-candidates 200 --log sweep.jsonl
    python benchmarks/tune_moe.py --tokens 1,16,64,256 --update --climb --sweep-ws --jobs 14 --max-candidates 48
    python benchmarks/tune_moe.py --tokens 1,16,64 --update --climb --sweep-groups --jobs 14 --max-candidates 60
    python benchmarks/tune_moe.py --models qwen3-30b-a3b --tokens 64 --update --climb --sweep-ws --sweep-gemms gemm2 \\
        --jobs 14 --max-candidates 60
    python benchmarks/tune_moe.py --tokens 1,16,64,256 --update --climb --sweep-loader --jobs 14 --max-candidates 24

For each (model, tokens), half of --max-candidates is spread over the grid, the rest climbs from the fastest of
those through configs one value away (with --climb: from the config the file serves the size with now, its own entry
or else the neighbouring entry select_config picks, or the default heuristic for a shape the file lacks, alone; the
on/off switches are tried first).  --sweep times, from that start, every tile shape x programs per SM x register
cap of GEMM1, then of GEMM2 (the other GEMM held at the best so far), before the climb; --sweep-ws each GEMM as the
warp-specialized kernel (sm90.gemm_gluon) in every tile shape x ring (K chunks per stage x stages) x register cap x
token tile; --sweep-groups each GEMM warp-specialized with two MMA warp groups sharing every tile
(GemmConfig.k_groups) x ring; --sweep-loader each GEMM in every narrow_tiles (x loader_warps where
warp-specialized).  Each candidate is checked against the torch reference first, then timed as bench_moe.py times
it: CUDA-graph replay over rotating weight copies, so L2 holds no weights between calls (harness.time_graph,
median; --no-rotate: one copy, which at Qwen3 T=1, 21 MB of touched weights, times L2, not HBM); the fastest valid
one is written.  --max-candidates bounds the timings per size, sweeps included.
--jobs N compiles each batch of candidates in N processes first (Triton's on-disk cache then serves the
timing process), as compiling, not timing, is most of a sweep's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_nvfp4 import MoEWeights, fused_moe_torch, prepare_moe_weights, quantize_nvfp4, topk_softmax  # noqa: E402
from moe_nvfp4.formats import NVFP4Tensor  # noqa: E402
from moe_nvfp4.layouts import FragmentLayout  # noqa: E402
from moe_nvfp4.shapes import LayerShape, device_traits  # noqa: E402
from moe_nvfp4.sm90.configs import CONFIG_VERSION, KERNEL_NAME, GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90.default_config import PAIR_TILE_TOKENS, default_config
from moe_nvfp4.sm90.host import fused_moe_sm90  # noqa: E402
from moe_nvfp4.sm90.tuned_configs import config_path, entry_shape, load_config_file, serving_entry
from moe_nvfp4.zoo import zoo_shape, zoo_shapes  # noqa: E402

# The zoo's shapes without expert parallelism (the tuner routes over the layer's own experts) and with gated experts
# (its layers and entries are gate-and-up ones): name -> (experts, top_k, hidden, intermediate).  By default the
# two shapes the shipped files tune.
MODELS = {
    s.key: (s.experts, s.top_k, s.hidden, s.intermediate) for s in zoo_shapes() if s.ep == 1 and s.activation.gated
}
DEFAULT_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")


def rotated_weights(
    weights: MoEWeights, topk_ids: torch.Tensor, held: list[MoEWeights] | None = None
) -> list[MoEWeights]:
    """``weights`` and as many clones (every tensor copied) as rotating through them takes for at least 4 x L2 of
    other weights to stream between two uses of one copy (harness.rotation_copies), counting the experts
    ``topk_ids`` touch: timing then pays cold weights, as in serving, where every other layer evicts a layer's
    weights.  ``held``: copies made for an earlier token count, reused."""
    from harness import rotation_copies

    touched = len(torch.unique(topk_ids)) * sum(t[0].numel() * t.element_size() for t in weights.tensors)
    wanted = rotation_copies(touched, torch.cuda.get_device_properties(0).L2_cache_size)
    copies = [weights] + list(held or [])[1:wanted]
    copies += [_cloned(weights) for _ in range(wanted - len(copies))]
    return copies


def _cloned(weights: MoEWeights) -> MoEWeights:
    tensors = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    return dataclasses.replace(weights, **{k: v.clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def make_layer(experts: int, hidden: int, inter: int, device: str, seed: int = 0, gated: bool = True):
    """Random NVFP4 w13 and w2, drawn and quantized a group of experts at a time (at most 2^30 float32 values of w13
    a group): Kimi-K2's layer is 45 GB as float32, more than a GPU holds beside its quantization's temporaries.
    w13 holds gate and up rows (2I, two global scales an expert), or I rows where ``gated`` is False (ReLU^2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (2 if gated else 1) * inter
    group = max(1, 2**30 // (rows * hidden))
    sizes = [min(group, experts - e) for e in range(0, experts, group)]

    def drawn(n: int, k: int, segments: int) -> NVFP4Tensor:
        parts = [
            quantize_nvfp4(torch.randn(g, n, k, device=device, generator=gen) / k**0.5, segments=segments)
            for g in sizes
        ]
        if len(parts) == 1:
            return parts[0]
        return NVFP4Tensor(
            *(torch.cat([getattr(q, f) for q in parts]) for f in ("packed", "block_scale", "global_scale"))
        )

    return drawn(rows, hidden, 2 if gated else 1), drawn(hidden, inter, 1)


def model_dims(model: str) -> tuple[int, int, int, int]:
    """(E, top-k, H, I) of a gated zoo key (MODELS) or of a random layer's key (``random-s0-03``: a row of the
    bench's random sweep); ValueError naming the key otherwise."""
    if model in MODELS:
        return MODELS[model]
    shape = zoo_shape(model)
    return shape.experts, shape.top_k, shape.hidden, shape.intermediate


def packed_layer(model: str, device: str = "cuda") -> MoEWeights:
    """``model``'s layer (make_layer's random weights) packed for the kernels, as fused_moe_sm90 takes them."""
    e, _, h, i = model_dims(model)
    return prepare_moe_weights(*make_layer(e, h, i, device))


def seeded_inputs(model: str, tokens: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """bf16 activations [tokens, H] and softmax top-k routing (topk_weights, topk_ids) for ``model``, seeded by
    ``tokens``: every benchmark that compares kernels at one size feeds them the same inputs."""
    e, k, h, _ = model_dims(model)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
    tw, ti = topk_softmax(torch.randn(tokens, e, device=device, generator=gen), k, renormalize=True)
    return x, tw, ti


# The values each GEMM's launch parameters are searched over.
GEMM_CHOICES = dict(
    block_n=(64, 128),
    num_warps=(4, 8),
    num_stages=(3, 4),
    programs_per_sm=(1, 2),
    max_registers=(None, 168, 128),
    warp_specialized=(False, True),
    chunks_per_stage=(1, 2, 4),
    narrow_tiles=(0, 1, 2),
    loader_warps=(1, 2, 4),
)
# k_groups only for the climb (from a --sweep-groups config): the grid would rarely meet its register caps;
# narrow_tiles and loader_warps too (from a warp-specialized config: the grid's are mostly the Triton kernel's)
CLIMB_ONLY = ("k_groups", "narrow_tiles", "loader_warps")
DECODE_GEMM_CHOICES = dict(GEMM_CHOICES, programs_per_sm=(1, 2, 3, 4), k_groups=(1, 2))
# --sweep's (block_n, num_warps) pairs: a 64-row tile is one warpgroup's wgmma, so 8 warps only for 128 rows
SWEEP_SHAPES = ((64, 4), (128, 4), (128, 8))
# --sweep-ws: the warp-specialized kernel's register cap -> the programs per SM it leaves room for (a 4-warp
# MMA group plus the loader's warp group: uncapped one program, 128 two, 80 three)
WS_RESIDENCY = ((None, 1), (128, 2), (80, 3))
# --sweep-ws: its rings, (K chunks per stage, stages): deeper rings of one chunk, or fewer stages of more
WS_RINGS = ((1, 4), (1, 6), (2, 2), (2, 4), (4, 2))
# --sweep-groups: two K groups of 4 MMA warps sharing a tile, with the register cap that fits one program of them
# and the loader's warp group on an SM; rings whose stages are a multiple of the groups
WS_K_GROUPS = ((2, 168),)
GROUP_RINGS = ((1, 4), (1, 6), (1, 8), (2, 2), (2, 4), (2, 6), (4, 2), (4, 4))


def search_space(tokens: int, experts: int, top_k: int) -> tuple[dict[str, tuple], dict[str, tuple[int, ...]]]:
    """(choices of the MoE-level fields, per-GEMM choices) for a token count.  Decode (<= 16 rows per
    expert) also tries more programs per SM, to hide the decode's latency, and (climbing) K groups.  Pair tiles
    (no routing kernel) are offered where the default may take them (configs.PAIR_TILE_TOKENS: one token's k pairs
    hit k distinct experts, two tokens' mostly do)."""
    rows = max(1, tokens * top_k // experts)
    block_ms = (8, 16) if rows <= 8 else (16, 32) if rows <= 24 else (32, 64) if rows <= 96 else (64, 128)
    # the on/off switches first: a short climb (--climb) tries them before the tile sizes
    moe = dict(
        partials_in_x_dtype=(False, True),
        pair_tiles=(False, True) if tokens <= PAIR_TILE_TOKENS else (False,),
        block_m=block_ms,
    )
    return moe, DECODE_GEMM_CHOICES if rows <= 16 else GEMM_CHOICES


def _valid(cfg: MoEKernelConfig, hidden: int, inter: int) -> bool:
    padded = FragmentLayout().padded_k  # K as the packed layout stores it
    return cfg.is_valid(padded(hidden), padded(inter))


def candidates(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> list[MoEKernelConfig]:
    """The grid: both GEMMs share every parameter; plus the default heuristic."""
    moe, choices = search_space(tokens, experts, top_k)
    shared = {f: v for f, v in choices.items() if f not in CLIMB_ONLY}
    out = {default_config(tokens, experts, top_k, hidden, inter)}
    for moe_values, values in itertools.product(itertools.product(*moe.values()), itertools.product(*shared.values())):
        gemm = GemmConfig(**dict(zip(shared, values)))
        cfg = MoEKernelConfig(**dict(zip(moe, moe_values)), gemm1=gemm, gemm2=gemm)
        if _valid(cfg, hidden, inter):
            out.add(cfg)
    return sorted(out, key=lambda c: json.dumps(c.to_dict(), sort_keys=True))


def neighbors(
    cfg: MoEKernelConfig, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """Valid configs differing from ``cfg`` in one value: a MoE-level field (token tile, partials' dtype,
    pair tiles; a token tile with narrow_tiles lowered where it must be, with_token_tile) or one parameter of
    one GEMM (so GEMM1 and GEMM2 may end up with different tiles, warps or programs per SM)."""
    moe, choices = search_space(tokens, experts, top_k)
    out = [
        cfg.with_token_tile(v) if f == "block_m" else dataclasses.replace(cfg, **{f: v})
        for f, values in moe.items()
        for v in values
        if v != getattr(cfg, f)
    ]
    for gemm in ("gemm1", "gemm2"):
        g = getattr(cfg, gemm)
        for f, values in choices.items():
            # switching kernels starts from their common settings (the Triton kernel: one chunk a stage, one group)
            reset = (
                {} if f != "warp_specialized" else dict(chunks_per_stage=1, k_groups=1, narrow_tiles=0, loader_warps=4)
            )
            out += [
                dataclasses.replace(cfg, **{gemm: dataclasses.replace(g, **{f: v, **reset})})
                for v in values
                if v != getattr(g, f)
            ]
    return [c for c in out if _valid(c, hidden, inter)]


def _spaced(items: list) -> list:
    """``items`` reordered so every prefix is spread over the whole list (bit-reversed index order)."""
    bits = max(1, (len(items) - 1).bit_length())
    return [items[i] for i in sorted(range(len(items)), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))]


def spread(cands: list[MoEKernelConfig], limit: int, first: MoEKernelConfig) -> list[MoEKernelConfig]:
    """At most ``limit`` configs: ``first``, then the others in a spread-out order (every prefix spread over the
    whole grid), so the whole grid is timed once the limit allows."""
    return [first] + _spaced([c for c in cands if c != first])[: limit - 1]


def gemm_sweep(
    cfg: MoEKernelConfig, gemm: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """``cfg`` with every valid (tile shape, programs per SM, register cap) of one GEMM; GEMM1's sweep also takes
    every token tile (block_m, which both GEMMs share, changes which GEMM1 shapes win)."""
    moe, choices = search_space(tokens, experts, top_k)
    g = getattr(cfg, gemm)
    out = []
    for block_m, (block_n, warps), pps, regs in itertools.product(
        moe["block_m"] if gemm == "gemm1" else (cfg.block_m,),
        SWEEP_SHAPES,
        choices["programs_per_sm"],
        choices["max_registers"],
    ):
        new = dataclasses.replace(g, block_n=block_n, num_warps=warps, programs_per_sm=pps, max_registers=regs)
        c = dataclasses.replace(cfg, **{gemm: new}).with_token_tile(block_m)
        if _valid(c, hidden, inter):
            out.append(c)
    return out


def _warp_specialized(
    cfg: MoEKernelConfig, gemm: str, settings: Iterable[dict], hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """``cfg`` with one GEMM warp-specialized in each of ``settings`` (GemmConfig fields), the valid ones in order;
    the other GEMM and the token tile kept."""
    g = getattr(cfg, gemm)
    out = [
        dataclasses.replace(cfg, **{gemm: dataclasses.replace(g, warp_specialized=True, **fields)})
        for fields in settings
    ]
    return [c for c in out if _valid(c, hidden, inter)]


def ws_sweep(
    cfg: MoEKernelConfig, gemm: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """``cfg`` with one GEMM warp-specialized in every valid tile shape x ring (chunks per stage, stages) x
    residency (register cap with the programs per SM it fits), at each token tile of the search space (8-token
    tiles need both GEMMs warp-specialized, so turning one GEMM Gluon can open them); the other GEMM kept."""
    moe, _ = search_space(tokens, experts, top_k)
    out = []
    for (block_n, warps), (chunks, stages), (regs, pps) in itertools.product(SWEEP_SHAPES, WS_RINGS, WS_RESIDENCY):
        setting = dict(
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            chunks_per_stage=chunks,
            max_registers=regs,
            programs_per_sm=pps,
        )
        for block_m in dict.fromkeys((cfg.block_m, *moe["block_m"])):
            out += _warp_specialized(cfg.with_token_tile(block_m), gemm, [setting], hidden, inter)
    return out


def group_sweep(
    cfg: MoEKernelConfig, gemm: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """``cfg`` with one GEMM warp-specialized as two K groups (GemmConfig.k_groups) of 64- or 128-row tiles, at
    their register cap, in every valid ring; one program per SM, the other GEMM and the token tile kept."""
    settings = (
        dict(
            block_n=block_n,
            num_warps=4,
            num_stages=stages,
            chunks_per_stage=chunks,
            max_registers=regs,
            programs_per_sm=1,
            k_groups=groups,
        )
        for block_n, (groups, regs), (chunks, stages) in itertools.product((64, 128), WS_K_GROUPS, GROUP_RINGS)
    )
    return _warp_specialized(cfg, gemm, settings, hidden, inter)


def loader_sweep(
    cfg: MoEKernelConfig, gemm: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> list[MoEKernelConfig]:
    """``cfg``'s GEMM in every valid narrow_tiles x loader_warps (the Triton kernel: narrow_tiles only; its other
    parameters, the other GEMM and the token tile kept): each changes what a tile's rows cost, not the tile
    shape."""
    g = getattr(cfg, gemm)
    warps = GEMM_CHOICES["loader_warps"] if g.warp_specialized else (g.loader_warps,)
    out = [
        dataclasses.replace(cfg, **{gemm: dataclasses.replace(g, narrow_tiles=narrow, loader_warps=w)})
        for narrow, w in itertools.product(GEMM_CHOICES["narrow_tiles"], warps)
    ]
    return [c for c in out if _valid(c, hidden, inter)]


def search(
    measure: Callable[[MoEKernelConfig], float | None],
    start: list[MoEKernelConfig],
    next_to: Callable[[MoEKernelConfig], list[MoEKernelConfig]],
    limit: int,
    sweeps: Sequence[Callable[[MoEKernelConfig], list[MoEKernelConfig]]] = (),
    prepare: Callable[[list[MoEKernelConfig]], None] = lambda configs: None,
) -> tuple[MoEKernelConfig, float] | None:
    """Time ``start`` (a spread over the grid), then each of ``sweeps`` in turn (every config it gives for
    the best so far), then climb: time the best config's untimed neighbours and move to the first faster
    one, until none is faster or ``limit`` configs were timed.  ``measure`` returns microseconds, or None for
    a config that failed (it counts against the limit); ``prepare`` sees each batch before it is timed."""
    timed: dict[MoEKernelConfig, float | None] = {}

    def run(cfg: MoEKernelConfig) -> float | None:
        timed[cfg] = measure(cfg)
        return timed[cfg]

    def run_batch(configs: list[MoEKernelConfig]) -> None:
        batch = [c for c in dict.fromkeys(configs) if c not in timed][: limit - len(timed)]
        prepare(batch)
        for cfg in batch:
            run(cfg)

    def fastest() -> MoEKernelConfig | None:
        ok = {c: us for c, us in timed.items() if us is not None}
        return min(ok, key=ok.get) if ok else None

    run_batch(start)
    for sweep in sweeps:
        if fastest() is not None:
            run_batch(sweep(fastest()))
    best = fastest()
    if best is None:
        return None
    improved = True
    while improved and len(timed) < limit:
        improved = False
        for cfg in next_to(best):
            if cfg in timed:
                continue
            us = run(cfg)
            if us is not None and us < timed[best]:
                best, improved = cfg, True
                break
            if len(timed) >= limit:
                break
    return best, timed[best]


_COMPILE_INPUTS: dict = {}


def _compile_worker(job: tuple) -> None:
    """--jobs: run one config once in a worker process, so Triton compiles it into its on-disk cache.  The
    weights are zeros of the real shapes and dtypes: what a kernel is specialized on, not the values."""
    weight_specs, tokens, experts, top_k, hidden, inter, dtype_name, cfg_dict = job
    key = (weight_specs, tokens, experts, top_k, hidden, dtype_name)
    if key not in _COMPILE_INPUTS:
        _COMPILE_INPUTS.clear()
        zeros = (torch.zeros(shape, dtype=getattr(torch, dt), device="cuda") for shape, dt in weight_specs)
        w = MoEWeights(*zeros, hidden=hidden, intermediate=inter)
        x = torch.zeros(tokens, hidden, device="cuda", dtype=getattr(torch, dtype_name))
        tw, ti = topk_softmax(torch.randn(tokens, experts, device="cuda"), top_k, renormalize=True)
        _COMPILE_INPUTS[key] = (x, w, tw, ti)
    x, w, tw, ti = _COMPILE_INPUTS[key]
    try:
        fused_moe_sm90(x, w, tw, ti, None, MoEKernelConfig.from_dict(cfg_dict))
        torch.cuda.synchronize()
    except Exception:  # the timing process reports it
        pass


def entry_key(entry: dict) -> tuple:
    """What a tuned entry is for: shape (shapes.LayerShape.entry_key) and token bound."""
    return *entry_shape(entry).entry_key, entry["max_tokens"]


def climb_start(entries: Sequence[dict], shape: LayerShape, tokens: int) -> list[MoEKernelConfig]:
    """What --update starts from for ``tokens`` of ``shape``: the config the file serves it with now (its own
    entry, else the entry select_config picks), so a size new to the file is climbed from its neighbour's config and
    the result is never slower there than the file was; nothing (the default heuristic) for a shape the file lacks
    or a size past its entries, where select_config serves the default."""
    entry = serving_entry([o for o in entries if entry_shape(o).entry_key == shape.entry_key], tokens)
    return [MoEKernelConfig.from_dict(entry["config"])] if entry is not None else []


def merge_entries(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` entries not re-tuned in ``new`` (same entry_key), then ``new``."""
    fresh = {entry_key(e) for e in new}
    return [e for e in old if entry_key(e) not in fresh] + new


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--tokens", default="1,16,64,256,1024,4096")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--probe", action="store_true", help="time the default heuristic only")
    p.add_argument("--max-candidates", type=int, default=24)
    p.add_argument("--out", default=None, help="JSON to write (default: configs/fused_moe_sm90/<device>.json)")
    p.add_argument(
        "--update", action="store_true", help="keep the file's entries for shapes and token counts not tuned now"
    )
    p.add_argument(
        "--climb",
        action="store_true",
        help="no spread: climb from the config the file serves this size with (its entry, or the entry "
        "select_config picks; the default for a shape the file lacks) only",
    )
    p.add_argument("--sweep", action="store_true", help="sweep GEMM1's, then GEMM2's, launch shapes before climbing")
    p.add_argument(
        "--sweep-ws",
        action="store_true",
        help="time each GEMM warp-specialized in every tile shape x stages x residency x token tile before climbing",
    )
    p.add_argument(
        "--sweep-gemms",
        default="gemm1,gemm2",
        choices=("gemm1,gemm2", "gemm1", "gemm2"),
        help="the GEMMs the --sweep* options sweep (in this order)",
    )
    p.add_argument(
        "--sweep-groups",
        action="store_true",
        help="time each GEMM warp-specialized with 2 K groups per tile, every ring, before climbing",
    )
    p.add_argument(
        "--sweep-loader",
        action="store_true",
        help="time each GEMM in every narrow_tiles (x loader_warps where warp-specialized) before climbing",
    )
    p.add_argument("--jobs", type=int, default=0, help="compile each batch of candidates in this many processes first")
    p.add_argument("--log", default=None, help="append every timing here (JSON lines)")
    p.add_argument(
        "--no-rotate",
        action="store_true",
        help="time one weight copy, which L2 may hold between calls at small T; by default each config "
        "is timed as bench_moe.py times it, rotating weight copies",
    )
    args = p.parse_args()
    log = open(args.log, "a") if args.log else None
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    from harness import time_graph

    dev = "cuda"
    dtype = getattr(torch, args.dtype)
    device = device_traits(torch.device(dev))
    name = device.name
    out_path = Path(args.out) if args.out else config_path(name)
    old_meta, old_entries = load_config_file(str(out_path)) if args.update and out_path.exists() else ({}, ())
    entries, lines = [], []
    # The file carries data: the device, the versions, the date and where the entries came from (an --update keeps
    # the file's own pointer; the tuner's logs are the results files, not the config's meta).
    produced_by = old_meta.get(
        "produced_by", "benchmarks/tune_moe.py; record: docs/design/002-hopper-kernel.md, section 'Tuned entries'"
    )
    meta = dict(
        kernel=KERNEL_NAME,
        version=CONFIG_VERSION,
        device=name,
        capability=list(device.capability),
        sm_count=device.sm_count,
        memory_gib=device.memory_gib,
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d"),
        produced_by=produced_by,
    )

    def write(new_entries: list[dict]) -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        merged = merge_entries(list(old_entries), new_entries)
        out_path.write_text(json.dumps({"meta": meta, "entries": merged}, indent=1) + "\n")
        print(f"wrote {out_path}", flush=True)

    for model in args.models.split(","):
        e, k, h, i = MODELS[model]
        q13, q2 = make_layer(e, h, i, dev)
        w = prepare_moe_weights(q13, q2)
        copies: list[MoEWeights] = []
        for t in [int(s) for s in args.tokens.split(",")]:
            x = torch.randn(t, h, device=dev, dtype=dtype)
            tw, ti = topk_softmax(torch.randn(t, e, device=dev), k, renormalize=True)
            ref = fused_moe_torch(x[:64], q13, q2, tw[:64], ti[:64]).float()
            copies = [w] if args.no_rotate else rotated_weights(w, ti, copies)
            errors: dict[MoEKernelConfig, float] = {}

            def measure(cfg: MoEKernelConfig) -> float | None:
                try:
                    out = fused_moe_sm90(x, w, tw, ti, None, cfg)
                    errors[cfg] = err = ((out[:64].float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print(f"  {model} T={t} {cfg}: rel err {err:.3g} -- rejected", flush=True)
                        return None
                    us = time_graph([lambda ws=ws: fused_moe_sm90(x, ws, tw, ti, None, cfg) for ws in copies]).median_us
                    if log is not None:
                        log.write(
                            json.dumps(
                                dict(
                                    model=model,
                                    tokens=t,
                                    us=round(us, 2),
                                    weight_copies=len(copies),
                                    config=cfg.to_dict(),
                                )
                            )
                            + "\n"
                        )
                        log.flush()
                    return us
                except Exception as exc:  # a config that fails to compile is skipped, not fatal
                    print(f"  {model} T={t} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    return None

            specs = tuple((tuple(a.shape), str(a.dtype).removeprefix("torch.")) for a in w.tensors)

            def prepare(batch: list[MoEKernelConfig]) -> None:
                if pool is not None and len(batch) > 1:
                    pool.map(
                        _compile_worker, [(specs, t, e, k, h, i, args.dtype, c.to_dict()) for c in batch], chunksize=1
                    )

            # each sweep asked for, in this order, over the GEMMs asked for
            kinds = [gemm_sweep] * args.sweep + [ws_sweep] * args.sweep_ws + [group_sweep] * args.sweep_groups
            kinds += [loader_sweep] * args.sweep_loader
            sweeps = [
                functools.partial(kind, gemm=g, tokens=t, experts=e, top_k=k, hidden=h, inter=i)
                for kind in kinds
                for g in args.sweep_gemms.split(",")
            ]
            first = default_config(t, e, k, h, i)
            if args.probe:
                found = search(measure, [first], lambda c: [], 1)
            else:  # half the budget spread over the grid, the rest climbing from the best of those
                incumbent = climb_start(old_entries, LayerShape(e, k, h, i, args.dtype), t)
                if args.climb:
                    start = incumbent or [first]
                else:
                    start = spread(candidates(t, e, k, h, i), max(1, args.max_candidates // 2), first)
                    start = incumbent + [c for c in start if c not in incumbent]  # --update: never worse than before
                found = search(
                    measure, start, lambda c: neighbors(c, t, e, k, h, i), args.max_candidates, sweeps, prepare
                )
            if found is None:
                lines.append(f"{model:>14} T={t:>5}: no valid config")
                continue
            cfg, us = found
            err = errors[cfg]
            lines.append(f"{model:>14} T={t:>5}: {us:9.1f} us  err {err:.2e}  {cfg}")
            print(lines[-1], flush=True)
            entries.append(
                dict(
                    experts=e,
                    top_k=k,
                    hidden=h,
                    intermediate=i,
                    dtype=args.dtype,
                    max_tokens=t,
                    config=cfg.to_dict(),
                    time_us=round(us, 2),
                )
            )
            if not args.probe:  # after every size: a long run stopped part way keeps what it found
                write(entries)
        del w, q13, q2, copies
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
