"""Selection: which tensors become NVFP4, grouped into units that are quantized together.

A unit is one expert's gate+up (they may share a global scale), one expert's down, one expert of a stacked
tensor, or one plain linear layer.  Everything else is copied unchanged.  Selection happens on headers only,
so every naming, dtype and shape problem is reported before anything is written.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import NVFP4
from .names import (
    ExpertWeight,
    LinearWeight,
    Other,
    Role,
    StackedExperts,
    TensorKind,
    claimed_experts,
    classify,
    expert_id_problem,
    gated_experts,
    stacked_output_name,
)
from .source import ConversionError, SourceCheckpoint, TensorInfo

__all__ = ["Selection", "QuantUnit", "Plan", "make_plan"]

FLOAT_DTYPES = ("BF16", "F16", "F32")
ROLE_ORDER = (Role.GATE, Role.UP, Role.DOWN)
NON_GATED_ROLES = (Role.UP, Role.DOWN)
# Why gpt-oss is refused: vLLM 0.26 and 0.33 cannot load NVFP4 gpt-oss experts in any layout.  GptOssForCausalLM.
# load_weights sends every checkpoint that is not MXFP4 or Quark to its BF16 loader, which copies the stacked
# gate_up_proj / down_proj and their biases into the layer's parameters itself (transposed, past every weight
# loader: NVFP4 scales are never read), and vLLM's ModelOpt NVFP4 MoE method creates no bias parameters.
GPT_OSS_REFUSAL = (
    "gpt-oss experts are not converted: vLLM (0.26, 0.33) loads gpt-oss experts only as BF16 stacked tensors, "
    "MXFP4 or Quark, so no NVFP4 gpt-oss checkpoint would load. Serve the BF16 checkpoint with "
    "--quantization nvfp4_grouped instead: its experts (interleaved gate/up, biases) are quantized on load"
)


@dataclass(frozen=True)
class Selection:
    """Which candidates to quantize: experts (default), all linear layers, or explicit regex lists.

    ``include`` patterns (``re.search`` on source tensor names) replace the default selection; ``exclude``
    patterns then remove tensors.  Routers, embeddings, norms and lm_head are never quantized.
    """

    all_linear: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern in (*self.include, *self.exclude):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"invalid regular expression {pattern!r}: {e}") from e

    def wants(self, kind: TensorKind) -> bool:
        if isinstance(kind, Other):
            return False
        if self.include:
            chosen = any(re.search(p, kind.name) for p in self.include)
        else:
            chosen = self.all_linear or not isinstance(kind, LinearWeight)
        return chosen and not any(re.search(p, kind.name) for p in self.exclude)


@dataclass(frozen=True)
class QuantUnit:
    """Tensors quantized together: ``modules`` (output names, no suffix) and ``load`` giving their [N, K] weights.

    With ``share_global`` all modules get one global scale, the max of their own (gate and up of an expert).
    """

    modules: tuple[str, ...]
    source: str  # source tensor name(s) for messages
    expert: int | None
    nbytes: int
    share_global: bool
    load: Callable[[SourceCheckpoint], list[torch.Tensor]]


@dataclass(frozen=True)
class Plan:
    """Work in source order: QuantUnit or the name of a tensor to copy; ``ignore``: unquantized linear modules."""

    work: list[QuantUnit | str]
    ignore: list[str]
    skipped: dict[str, str]  # selected but left unquantized -> reason


def _check_float(info: TensorInfo, k: int) -> None:
    if info.dtype not in FLOAT_DTYPES:
        raise ConversionError(
            f"{info.name} (in {info.shard}): dtype {info.dtype}, expected one of {FLOAT_DTYPES}; "
            "is the checkpoint already quantized?"
        )
    if k % NVFP4.block_size:
        raise ConversionError(f"{info.name}: K={k} is not a multiple of {NVFP4.block_size}; NVFP4 cannot hold it")


def _load_one(name: str) -> Callable[[SourceCheckpoint], list[torch.Tensor]]:
    return lambda src: [src.load(name)]


def _load_pair(gate: str, up: str) -> Callable[[SourceCheckpoint], list[torch.Tensor]]:
    return lambda src: [src.load(gate), src.load(up)]


def _load_stacked(
    name: str, expert: int, parts: int, transposed: bool
) -> Callable[[SourceCheckpoint], list[torch.Tensor]]:
    def load(src: SourceCheckpoint) -> list[torch.Tensor]:
        w = src.load_expert(name, expert)
        return list((w.T if transposed else w).chunk(parts, dim=0))

    return load


def _model_dims(config: dict) -> tuple[int, int] | None:
    """(hidden size H, expert intermediate size I) from config.json (or its text_config), or None."""
    for holder in (config, config.get("text_config")):
        if not isinstance(holder, dict):
            continue
        h = holder.get("hidden_size")
        i = holder.get("moe_intermediate_size", holder.get("intermediate_size"))
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (h, i)):
            return h, i
    return None


def _stacked_orientation(src: SourceCheckpoint, infos: list[tuple[TensorInfo, StackedExperts]]) -> bool:
    """Whether one layer's stacked tensors are ``[E, K, N]`` (transformers' Llama-4 / gpt-oss layout) rather than
    ``[E, N, K]``, decided from the config's H and I: gate_up is ``[E, 2I, H]`` or ``[E, H, 2I]``, down
    ``[E, H, I]`` or ``[E, I, H]``.  Refused where the config lacks the sizes or the shapes fit neither."""
    dims = _model_dims(src.config)
    names = [info.name for info, _ in infos]
    if dims is None:
        raise ConversionError(
            f"{names[0]}: stacked experts {infos[0][0].shape}, but config.json has no hidden_size and "
            "(moe_)intermediate_size to tell [E, 2I, H] from [E, H, 2I]"
        )
    if src.config.get("model_type") == "gpt_oss":
        raise ConversionError(f"{names[0]}: {GPT_OSS_REFUSAL}")
    h, i = dims
    votes = set()
    for info, kind in infos:
        rows = i * len(kind.roles) if kind.roles[0] is not Role.DOWN else h
        cols = h if kind.roles[0] is not Role.DOWN else i
        fits = {o for o, shape in ((False, (rows, cols)), (True, (cols, rows))) if info.shape[1:] == shape}
        if not fits:
            raise ConversionError(
                f"{info.name}: shape {info.shape} fits neither [E, {rows}, {cols}] nor [E, {cols}, {rows}] "
                f"(hidden_size {h}, intermediate size {i} in config.json)"
            )
        if len(fits) == 1:
            votes |= fits
    if len(votes) != 1:
        why = "disagree" if votes else "are square, so their orientation is ambiguous"
        raise ConversionError(f"{names}: the stacked expert tensors {why}; cannot tell [E, N, K] from [E, K, N]")
    return votes.pop()


def _no_experts_error(src: SourceCheckpoint, kinds: dict[str, TensorKind]) -> ConversionError:
    weights = [n for n, k in kinds.items() if not isinstance(k, Other)][:8]
    return ConversionError(
        f"{src.root}: no routed expert weights recognised among {len(kinds)} tensors "
        "(expected '<prefix>.experts.<E>.w1|w2|w3.weight', '<prefix>.experts.<E>.gate_proj|up_proj|down_proj.weight' "
        f"or stacked '<prefix>.experts.gate_up_proj|down_proj'); linear weights found: {weights}. "
        "Use --all-linear or --include REGEX to choose tensors explicitly."
    )


def _check_not_transposed(src: SourceCheckpoint, gate: TensorInfo, down: TensorInfo) -> None:
    """Per-expert weights are ``[N, K]`` (gate ``[I, H]``, down ``[H, I]``); a ``[K, N]`` copy would quantize along
    the wrong axis and still load, so it is refused where the config gives H and I."""
    dims = _model_dims(src.config)
    if dims is None or dims[0] == dims[1]:
        return
    h, i = dims
    for info, want in ((gate, (i, h)), (down, (h, i))):
        if info.shape == want[::-1]:
            raise ConversionError(
                f"{info.name}: shape {info.shape} is the transpose of [N, K] = {list(want)} "
                f"(hidden_size {h}, intermediate size {i}); store experts as [out, in]"
            )


def _expert_units(src: SourceCheckpoint, experts: list[ExpertWeight], shared: bool) -> list[tuple[str, QuantUnit]]:
    by_expert: dict[tuple[str, int], dict[Role, ExpertWeight]] = defaultdict(dict)
    for w in experts:
        by_expert[(w.prefix, w.expert)][w.role] = w
    gated = gated_experts(src.config)
    wanted = ROLE_ORDER if gated else NON_GATED_ROLES
    units = []
    for (prefix, e), roles in by_expert.items():
        found = [w.name for w in roles.values()]
        missing = [r.value for r in wanted if r not in roles]
        if missing:
            raise ConversionError(f"{prefix}.{e}: expert has no {missing} projection (found {found})")
        if not gated and Role.GATE in roles:
            raise ConversionError(
                f"{prefix}.{e}: {roles[Role.GATE].name}: model_type {src.config.get('model_type')} "
                f"has non-gated experts (up and down only), yet this expert has a gate"
            )
        info = {r: src.tensors[roles[r].name] for r in wanted}
        up, down = info[Role.UP], info[Role.DOWN]
        if not gated:
            _check_not_transposed(src, up, down)
            units += [
                (
                    info[r].name,
                    QuantUnit((roles[r].module,), info[r].name, e, info[r].nbytes, False, _load_one(info[r].name)),
                )
                for r in wanted
            ]
            continue
        gate = info[Role.GATE]
        if gate.shape != up.shape:
            raise ConversionError(
                f"{prefix}.{e}: gate {gate.name} {gate.shape} and up {up.name} {up.shape} differ in shape"
            )
        _check_not_transposed(src, gate, down)
        if shared:
            gu = [
                QuantUnit(
                    (roles[Role.GATE].module, roles[Role.UP].module),
                    f"{gate.name}, {up.name}",
                    e,
                    gate.nbytes + up.nbytes,
                    True,
                    _load_pair(gate.name, up.name),
                )
            ]
        else:
            gu = [
                QuantUnit((roles[r].module,), info[r].name, e, info[r].nbytes, False, _load_one(info[r].name))
                for r in (Role.GATE, Role.UP)
            ]
        units += [(gate.name, u) for u in gu]
        units.append(
            (down.name, QuantUnit((roles[Role.DOWN].module,), down.name, e, down.nbytes, False, _load_one(down.name)))
        )
    return units


def _stacked_units(info: TensorInfo, kind: StackedExperts, shared: bool, transposed: bool) -> list[QuantUnit]:
    n_experts, rows, cols = info.shape
    if transposed:
        rows, cols = cols, rows
    if n_experts == 0:
        raise ConversionError(f"{info.name}: shape {info.shape} holds zero experts")
    parts = len(kind.roles)
    if rows % parts:
        raise ConversionError(f"{info.name}: {rows} rows do not split into {[r.value for r in kind.roles]}")
    per_expert = info.nbytes // n_experts
    units = []
    for e in range(n_experts):
        modules = tuple(stacked_output_name(kind.prefix, e, r) for r in kind.roles)
        load = _load_stacked(info.name, e, parts, transposed)
        units.append(QuantUnit(modules, info.name, e, per_expert, shared or parts == 1, load))
    return units


def _check_expert_ids(src: SourceCheckpoint, kinds: dict[str, TensorKind], layers: dict[str, list[str]]) -> None:
    """Each quantized MoE layer's experts are ``0 .. E-1`` with E what config.json says (where it says), checked
    from the names present (``names.expert_id_problem``) before anything is written."""
    claimed = claimed_experts(src.config)
    for prefix, names in layers.items():
        stacked = [src.tensors[n].shape[0] for n in names if isinstance(kinds[n], StackedExperts)]
        ids = (
            range(max(stacked))
            if stacked
            else sorted({k.expert for n in names if isinstance(k := kinds[n], ExpertWeight)})
        )
        problem = expert_id_problem(prefix, ids, claimed)
        if problem:
            raise ConversionError(f"{problem[0]}: {problem[1]}")


def make_plan(src: SourceCheckpoint, selection: Selection, *, separate_gate_up_scales: bool = False) -> Plan:
    """Classify every tensor, check the selected ones, and order the work as the source files hold it."""
    kinds = {name: classify(name, info.shape) for name, info in src.tensors.items()}
    if (
        not selection.include
        and not selection.all_linear
        and not any(isinstance(k, (ExpertWeight, StackedExperts)) for k in kinds.values())
    ):
        raise _no_experts_error(src, kinds)
    shared = not separate_gate_up_scales
    chosen = {n: k for n, k in kinds.items() if selection.wants(k)}  # source order: errors are deterministic
    if not chosen:
        raise ConversionError(
            f"{src.root}: the selection matches no quantizable tensor (include={selection.include}, exclude={selection.exclude})"
        )

    # Experts of one layer are quantized all together or not at all: engines load them as one MoE layer.
    layers: dict[str, list[str]] = defaultdict(list)
    for n, k in kinds.items():
        if isinstance(k, (ExpertWeight, StackedExperts)):
            layers[k.prefix].append(n)
    for prefix, names in layers.items():
        picked = [n for n in names if n in chosen]
        if picked and len(picked) != len(names):
            left = sorted(set(names) - set(picked))
            raise ConversionError(
                f"{prefix}: the selection quantizes {len(picked)} of {len(names)} expert tensors (left out e.g. {left[:3]}); "
                "an MoE layer must be quantized whole; adjust --include/--exclude"
            )

    anchored: dict[str, list[QuantUnit]] = defaultdict(list)
    skipped: dict[str, str] = {}
    ignore: list[str] = []
    experts: list[ExpertWeight] = []
    stacked: dict[str, list[tuple[TensorInfo, StackedExperts]]] = defaultdict(list)
    for name, kind in chosen.items():
        if isinstance(kind, StackedExperts):
            stacked[kind.prefix].append((src.tensors[name], kind))
    transposed = {prefix: _stacked_orientation(src, infos) for prefix, infos in stacked.items()}
    for name, kind in chosen.items():
        info = src.tensors[name]
        if isinstance(kind, StackedExperts):
            _check_float(info, info.shape[1 if transposed[kind.prefix] else 2])
            anchored[name] += _stacked_units(info, kind, shared, transposed[kind.prefix])
            continue
        if not isinstance(kind, LinearWeight):
            _check_float(info, info.shape[-1])
        if isinstance(kind, ExpertWeight):
            experts.append(kind)
        elif info.dtype not in FLOAT_DTYPES or info.shape[-1] % NVFP4.block_size:
            skipped[name] = f"dtype {info.dtype}, K={info.shape[-1]}: not a float weight with K a multiple of 16"
        else:
            anchored[name].append(QuantUnit((kind.module,), name, None, info.nbytes, False, _load_one(name)))
    for anchor, unit in _expert_units(src, experts, shared):
        anchored[anchor].append(unit)
    _check_expert_ids(src, kinds, {prefix: names for prefix, names in layers.items() if names[0] in chosen})

    covered = {n for n in chosen if n not in skipped}
    for prefix, names in layers.items():
        if not any(n in covered for n in names):
            ignore.append(prefix)
    for n, k in kinds.items():
        if n in covered:
            continue
        if isinstance(k, LinearWeight) or (isinstance(k, Other) and k.reason in ("router", "lm_head")):
            ignore.append(n.removesuffix(".weight"))

    work: list[QuantUnit | str] = []
    for name in src.tensors:
        if name in anchored:
            work += anchored[name]
        elif name not in covered:
            work.append(name)
    return Plan(work, sorted(ignore), skipped)
