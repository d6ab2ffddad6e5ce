"""Which checkpoint tensors are routed experts, plain linear layers, or left alone: explicit name maps.

Recognised expert layouts (HF names, as the files hold them):

* per-expert, Mixtral:                 ``<prefix>.experts.<E>.w1|w3|w2.weight`` (w1 = gate, w3 = up, w2 = down)
* per-expert, Qwen2/3-MoE, DeepSeek:   ``<prefix>.experts.<E>.gate_proj|up_proj|down_proj.weight``
* per-expert, non-gated, NemotronH:    ``backbone.layers.N.mixer.experts.<E>.up_proj|down_proj.weight`` (ReLU²
  experts: no gate; vLLM loads ``up_proj`` as its w13).  Only for ``NON_GATED_MODEL_TYPES``: elsewhere a missing
  gate is an error.
* stacked, transformers 5 in memory:   ``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then
  up) and ``<prefix>.experts.down_proj`` ``[E, H, I]``; no ``.weight`` suffix.  ``save_pretrained`` of
  transformers 5.17 writes the per-expert names for Mixtral and Qwen3-MoE, but a raw ``state_dict`` dump
  holds these.  The transposed ``[E, H, 2I]`` / ``[E, I, H]`` (Llama-4's ``feed_forward.experts``, as its
  checkpoints store them) is told apart by ``plan.py`` from config.json's sizes.  Written per expert
  (``<prefix>.<E>.gate_proj|up_proj|down_proj``), the names vLLM's Llama-4 loader and ModelOpt use.
* gpt-oss (``model_type`` ``gpt_oss``) is refused, see ``plan.GPT_OSS_REFUSAL``.

Shared experts (``shared_expert.`` in Qwen2-MoE, ``shared_experts.`` in DeepSeek) are not routed experts: the
pattern needs ``.experts.`` right after a dot, so they only count as plain linear layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

__all__ = [
    "Role",
    "ExpertWeight",
    "StackedExperts",
    "LinearWeight",
    "Other",
    "TensorKind",
    "classify",
    "claimed_experts",
    "expert_id_problem",
    "gated_experts",
    "stacked_output_name",
]


class Role(str, Enum):
    GATE = "gate"
    UP = "up"
    DOWN = "down"


# Per-expert projection name -> role.  Output keeps the source's projection name.
PROJECTION_ROLES: dict[str, Role] = {
    "w1": Role.GATE,
    "w3": Role.UP,
    "w2": Role.DOWN,
    "gate_proj": Role.GATE,
    "up_proj": Role.UP,
    "down_proj": Role.DOWN,
}

# Stacked tensor name -> roles of its row halves (in order).  Output uses the generic projection names.
STACKED_ROLES: dict[str, tuple[Role, ...]] = {
    "gate_up_proj": (Role.GATE, Role.UP),
    "down_proj": (Role.DOWN,),
}
STACKED_OUTPUT_PROJECTION: dict[Role, str] = {Role.GATE: "gate_proj", Role.UP: "up_proj", Role.DOWN: "down_proj"}

# 2-D ``.weight`` tensors that are never quantized, with the reason (matched with re.search).
NOT_LINEAR: dict[str, str] = {
    r"(^|\.)lm_head\.": "lm_head",
    r"embed": "embedding",
    r"norm": "norm",
    r"(^|\.)(gate|router)\.weight$": "router",
    r"shared_expert_gate\.weight$": "router",
}

# Model types whose experts have no gate projection (vLLM builds them with a ``*_no_mul`` activation).
NON_GATED_MODEL_TYPES = ("nemotron_h",)

# config.json keys (top level or text_config) that give the number of routed experts, per model family.
NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\.(?P<proj>[a-z0-9_]+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertWeight:
    """One expert's projection, ``[N, K]``; ``module`` is the name without ``.weight``."""

    name: str
    prefix: str  # ``...experts``
    expert: int
    role: Role

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


@dataclass(frozen=True)
class StackedExperts:
    """All experts of one layer in one tensor ``[E, rows, K]``; ``roles`` are its row blocks in order."""

    name: str
    prefix: str
    roles: tuple[Role, ...]


@dataclass(frozen=True)
class LinearWeight:
    """A plain linear layer's ``[N, K]`` weight (quantized only with ``--all-linear`` or ``--include``)."""

    name: str

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


@dataclass(frozen=True)
class Other:
    """Copied unchanged; ``reason`` says why it is not a candidate."""

    name: str
    reason: str


TensorKind = ExpertWeight | StackedExperts | LinearWeight | Other


def classify(name: str, shape: tuple[int, ...]) -> TensorKind:
    """Classify one tensor by name and rank."""
    m = _PER_EXPERT.match(name)
    if m and m["proj"] in PROJECTION_ROLES and len(shape) == 2:
        return ExpertWeight(name, m["prefix"], int(m["expert"]), PROJECTION_ROLES[m["proj"]])
    m = _STACKED.match(name)
    if m and len(shape) == 3:
        return StackedExperts(name, m["prefix"], STACKED_ROLES[m["proj"]])
    if not name.endswith(".weight") or len(shape) != 2:
        return Other(name, "not a 2-D .weight")
    for pattern, reason in NOT_LINEAR.items():
        if re.search(pattern, name):
            return Other(name, reason)
    return LinearWeight(name)


def gated_experts(config: dict) -> bool:
    """Whether config.json's model (or its text_config) has gate + up experts rather than one up projection."""
    holders = [h for h in (config, config.get("text_config")) if isinstance(h, dict)]
    return not any(
        h.get("model_type") in NON_GATED_MODEL_TYPES for h in holders if isinstance(h.get("model_type"), str)
    )


def stacked_output_name(prefix: str, expert: int, role: Role) -> str:
    """Per-expert module name written for one expert of a stacked tensor."""
    return f"{prefix}.{expert}.{STACKED_OUTPUT_PROJECTION[role]}"


def claimed_experts(config: dict[str, Any]) -> tuple[str, int] | None:
    """(key, count) of the routed experts config.json (or its text_config) declares, or None."""
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            for key in NUM_EXPERTS_KEYS:
                value = holder.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return key, value
    return None


def expert_id_problem(layer: str, ids: Sequence[int], claimed: tuple[str, int] | None) -> tuple[str, str] | None:
    """(the first expert at fault, what is wrong) with one MoE layer's expert ids, or None.

    ``ids`` are sorted and distinct, as the tensor names give them.  Engines load experts ``0 .. E-1``: ids with
    gaps, or a count other than config.json's, would load as missing or shifted experts.  Works from the ids
    present (never loops up to a claimed count or the largest id, which a hostile name can make 10**12) and
    names the first few missing ids.
    """
    if ids and ids[-1] != len(ids) - 1:
        missing, expected = [], 0
        for i in ids:
            missing += range(expected, min(i, expected + 3 - len(missing)))
            expected = i + 1
            if len(missing) >= 3:
                break
        more = " ..." if ids[-1] + 1 - len(ids) > len(missing) else ""
        return f"{layer}.{missing[0]}", (
            f"missing: expert ids have gaps, {len(ids)} experts with ids up to {ids[-1]} "
            f"(missing {missing}{more}); a layer's experts are numbered 0..E-1"
        )
    if claimed is not None and len(ids) != claimed[1]:
        key, count = claimed
        what = "missing" if len(ids) < count else "outside the config's experts"
        return f"{layer}.{min(len(ids), count)}", (
            f"{what}: the checkpoint has {len(ids)} experts (0..{len(ids) - 1}), "
            f"config.json says {count} ({key}); the two must agree"
        )
    return None
