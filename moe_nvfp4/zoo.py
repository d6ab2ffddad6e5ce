"""The model zoo: MoE layer shapes of the models people serve, and the per-rank shapes TP and EP give them.

One definition for the benchmark, the tuner, the autotuner's tests and the config tests.  A shape is what one
GPU's ``fused_moe`` sees: ``experts`` local experts of ``global_experts`` (expert parallelism keeps E / EP of
them, the rest map to -1), ``intermediate`` the local slice of each expert's intermediate size (tensor
parallelism splits it), ``top_k`` and ``hidden`` unchanged.

    zoo_shapes()                  every shape: each model at TP=1, then its per-rank shapes
    zoo_shapes("qwen3-235b-a22b") one model's shapes;  zoo_shape("kimi-k2-ep8") one shape
    random_models(16, seed=0)     16 layers drawn at random (generality beyond the zoo); random_model("random-s0-03")
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from .expert_activation import RELU2, SILU, ExpertActivation
from .shapes import LayerShape

__all__ = [
    "ZooModel",
    "ZooShape",
    "MODELS",
    "SPLITS",
    "RANDOM_BOUNDS",
    "RandomBounds",
    "random_model",
    "random_models",
    "zoo_shape",
    "zoo_shapes",
]


@dataclass(frozen=True)
class ZooModel:
    """A model's routed-expert layer: E experts, top-k, hidden size H, expert intermediate size I, and the experts'
    activation (expert_activation: gated SiLU unless the model says otherwise; w13 then has I rows, not 2I)."""

    key: str
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    large: bool = False  # served across GPUs: the zoo adds its TP and EP per-rank shapes
    activation: ExpertActivation = SILU


@dataclass(frozen=True)
class ZooShape:
    """One GPU's share of a model's MoE layer under TP=tp or EP=ep (see the module docstring): a zoo entry is its
    model, the parallel split and the ``layer`` (``shapes.LayerShape``) they give; the fields below read as
    LayerShape's do."""

    model: ZooModel
    tp: int = 1
    ep: int = 1

    @property
    def key(self) -> str:
        return self.model.key + (f"-tp{self.tp}" if self.tp > 1 else f"-ep{self.ep}" if self.ep > 1 else "")

    @property
    def name(self) -> str:
        return self.model.name + (f" TP{self.tp}" if self.tp > 1 else f" EP{self.ep}" if self.ep > 1 else "")

    @property
    def experts(self) -> int:
        return self.model.experts // self.ep

    @property
    def global_experts(self) -> int:
        return self.model.experts

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def intermediate(self) -> int:
        return self.model.intermediate // self.tp

    @property
    def activation(self) -> ExpertActivation:
        return self.model.activation

    @property
    def layer(self) -> LayerShape:
        """What this rank's ``fused_moe`` sees, as configs are chosen for it (bf16 activations)."""
        gated = self.activation.gated
        return LayerShape(
            self.experts, self.top_k, self.hidden, self.intermediate, "bfloat16", self.global_experts, gated
        )


MODELS: tuple[ZooModel, ...] = (
    ZooModel("mixtral-8x7b", "Mixtral-8x7B", 8, 2, 4096, 14336),
    ZooModel("mixtral-8x22b", "Mixtral-8x22B", 8, 2, 6144, 16384, large=True),
    ZooModel("qwen3-30b-a3b", "Qwen3-30B-A3B", 128, 8, 2048, 768),
    ZooModel("qwen3-235b-a22b", "Qwen3-235B-A22B", 128, 8, 4096, 1536, large=True),
    ZooModel("kimi-k2", "Kimi-K2", 384, 8, 7168, 2048, large=True),
    ZooModel("glm-4.5", "GLM-4.5", 160, 8, 5120, 1536, large=True),
    ZooModel("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", 512, 10, 2048, 512),
    ZooModel("gpt-oss-120b", "gpt-oss-120b", 128, 4, 2880, 2880, large=True),
    ZooModel("llama-4-maverick", "Llama-4-Maverick", 128, 1, 5120, 8192, large=True),
    ZooModel("dbrx", "DBRX", 16, 4, 6144, 10752, large=True),
    ZooModel("phi-3.5-moe", "Phi-3.5-MoE", 16, 2, 4096, 6400),
    ZooModel("olmoe", "OLMoE", 64, 8, 2048, 1024),
    ZooModel("nemotron-3-nano", "Nemotron-3-Nano", 128, 6, 2688, 1856, activation=RELU2),
)

# The per-rank splits of the large models: (tensor parallel, expert parallel) sizes.
SPLITS: tuple[tuple[int, int], ...] = ((2, 1), (4, 1), (8, 1), (1, 2), (1, 8))
# NVFP4 scales cover 16 values of K, and I is GEMM2's K: a TP slice must keep whole blocks.
_SCALE_BLOCK = 16


def _split(model: ZooModel, tp: int, ep: int) -> ZooShape | None:
    """``model`` on one rank of TP=tp or EP=ep; None where the split does not divide the model (a TP slice of I
    that is not whole NVFP4 blocks, e.g. gpt-oss's 2880 / 8 = 360, or fewer experts than ranks)."""
    if model.intermediate % (tp * _SCALE_BLOCK) or model.experts % ep:
        return None
    return ZooShape(model, tp, ep)


def zoo_shapes(model: str | None = None) -> list[ZooShape]:
    """Every zoo shape (or one model's): the model at TP=1, then its per-rank shapes if it is large."""
    out = []
    for m in MODELS:
        if model is not None and m.key != model:
            continue
        out += [s for s in (_split(m, tp, ep) for tp, ep in ((1, 1), *(SPLITS if m.large else ()))) if s]
    if model is not None and not out:
        raise ValueError(f"unknown zoo model {model!r}; choose from {[m.key for m in MODELS]}")
    return out


def zoo_shape(key: str) -> ZooShape:
    """One shape by key (``qwen3-235b-a22b``, ``kimi-k2-ep8``, ``glm-4.5-tp4``, or a random layer's
    ``random-s0-03``: random_model)."""
    if key.startswith("random-s"):
        return ZooShape(random_model(key))
    for shape in zoo_shapes():
        if shape.key == key:
            return shape
    raise ValueError(f"unknown zoo shape {key!r}; choose from {[s.key for s in zoo_shapes()]}")


# --------------------------------------------------------------------------------------------------
# Random layers: a kernel's default must hold on shapes nobody tuned (issue 58), so the bench draws some
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandomBounds:
    """What random_models draws from: E log-uniform in [min_experts, max_experts] (as many small-E layers as large
    ones), top-k uniform in [1, min(max_top_k, E)], H and I uniform over the multiples of ``dim_step`` in
    [min_dim, max_dim]; gated SiLU experts.  A draw with more expert parameters (E x 3 x H x I) than
    ``max_params`` is drawn again: a layer beyond the zoo's largest would not fit all the bench's paths (ours,
    Marlin, Humming and the BF16 copy) beside each other on one GPU."""

    min_experts: int = 8
    max_experts: int = 512
    max_top_k: int = 10
    min_dim: int = 1024
    max_dim: int = 8192
    dim_step: int = 128
    max_params: int = max(m.experts * (3 if m.activation.gated else 2) * m.hidden * m.intermediate for m in MODELS)


RANDOM_BOUNDS = RandomBounds()
RANDOM_SEED = 0  # random_models' seed when none is given
_RANDOM_KEY = re.compile(r"random-s(\d+)-(\d+)")


def _uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] from rng.random() alone: Python keeps random()'s sequence for a seed across
    versions, not randrange's or choice's."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


def random_models(count: int, seed: int = RANDOM_SEED, bounds: RandomBounds = RANDOM_BOUNDS) -> list[ZooModel]:
    """The first ``count`` layers of ``seed``'s sequence (so random_models(4, s) is random_models(16, s)[:4]), keyed
    ``random-s<seed>-<index>`` (random_model reads the key back) and named by their shape."""
    if count < 1:
        raise ValueError(f"count={count}: draw at least one random layer")
    if seed < 0:
        raise ValueError(f"seed={seed}: must be >= 0")
    rng = random.Random(seed)
    out: list[ZooModel] = []
    steps = (bounds.max_dim - bounds.min_dim) // bounds.dim_step
    log_low, log_high = math.log(bounds.min_experts), math.log(bounds.max_experts + 1)
    while len(out) < count:
        experts = min(int(math.exp(log_low + rng.random() * (log_high - log_low))), bounds.max_experts)
        top_k = _uniform_int(rng, 1, min(bounds.max_top_k, experts))
        hidden, inter = (bounds.min_dim + bounds.dim_step * _uniform_int(rng, 0, steps) for _ in range(2))
        if experts * 3 * hidden * inter > bounds.max_params:
            continue
        key = f"random-s{seed}-{len(out):02d}"
        out.append(ZooModel(key, f"{key} E={experts} top-{top_k} H={hidden} I={inter}", experts, top_k, hidden, inter))
    return out


def random_model(key: str) -> ZooModel:
    """The layer a ``random-s<seed>-<index>`` key names (random_models' keys): a row of a random sweep, rerun."""
    match = _RANDOM_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key!r} is not a random layer's key (random-s<seed>-<index>, e.g. random-s0-03)")
    seed, index = int(match.group(1)), int(match.group(2))
    return random_models(index + 1, seed)[index]
