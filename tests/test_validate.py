"""One validator, three consumers: every corruption reaches ``inspect``, the converter's self-check
(``verify_output``) and the vLLM loader's check (``validate_loaded_experts``, marked vllm) and gets the same
verdict naming the same tensor.

Tolerances: none; verdicts and tensor names are compared exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from moe_nvfp4.checkpoint import TENSOR_NAMES, CheckpointError, Convention, NVFP4Linear, to_checkpoint
from moe_nvfp4.cli import main
from moe_nvfp4.convert import ConversionError, inspect_checkpoint
from moe_nvfp4.convert.convert import verify_output
from moe_nvfp4.formats import global_scale_for, quantize_nvfp4
from moe_nvfp4.validate import INPUT_SCALE_OUTLIER_RATIO, check_moe_layer, stacked_layer_clean

LAYER = "model.layers.0.mlp.experts"
E, H, I = 4, 64, 32
PROJ = ("gate_proj", "up_proj", "down_proj")
SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

Tensors = dict[str, torch.Tensor]


def build_layer(gen: torch.Generator, convention: Convention, w4a4: bool) -> Tensors:
    """E experts of random weights (full e2m1 range: gaussian rows of different magnitudes), gate and up sharing
    one global scale as the converter writes them; W4A4 input scales vary within 4x across experts."""
    out: Tensors = {}
    for e in range(E):
        w = {
            p: torch.randn(*(H, I) if p == "down_proj" else (I, H), generator=gen)
            * (1 + 3 * torch.rand(1, generator=gen))
            for p in PROJ
        }
        shared = torch.maximum(global_scale_for(w["gate_proj"]), global_scale_for(w["up_proj"]))
        for p in PROJ:
            q = quantize_nvfp4(w[p], None if p == "down_proj" else shared)
            inp = torch.tensor(0.01 * (1 + 3 * float(torch.rand(1, generator=gen)))) if w4a4 else None
            for suffix, t in to_checkpoint(NVFP4Linear(q, inp), convention).items():
                out[f"{LAYER}.{e}.{p}.{suffix}"] = t.clone()  # gate and up share the scale's storage
    return out


def write_checkpoint(root: Path, tensors: Tensors, convention: Convention, w4a4: bool) -> Path:
    root.mkdir()
    if convention is Convention.MODELOPT:
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4" if w4a4 else "W4A16_NVFP4"}
    else:
        act = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
        qc = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": act, "input_activations": act if w4a4 else None}},
        }
    config = {
        "model_type": "mixtral",
        "hidden_size": H,
        "intermediate_size": I,
        "num_local_experts": E,
        "quantization_config": qc,
    }
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def loader_params(
    tensors: Tensors, convention: Convention
) -> tuple[dict[str, torch.Tensor], set[tuple[str, int, str]]]:
    """What the vLLM method holds after loading: stacked ``w13_*`` / ``w2_*`` params (NaN where nothing
    arrived, as create_weights fills them) and the (param, expert, shard) set that did arrive."""
    packed, scale, global_, input_, _ = TENSOR_NAMES[convention]
    shapes = {
        packed: lambda n, k: ((n, k // 2), torch.uint8),
        scale: lambda n, k: ((n, k // 16), torch.float8_e4m3fn),
        global_: lambda n, k: ((), torch.float32),
        input_: lambda n, k: ((), torch.float32),
    }
    params, loaded = {}, set()
    for suffix, shape_of in shapes.items():
        for prefix, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            parts = []
            for e in range(E):
                per = []
                for p in projs:
                    n, k = (H, I) if p == "down_proj" else (I, H)
                    shape, dtype = shape_of(n, k)
                    t = tensors.get(f"{LAYER}.{e}.{p}.{suffix}")
                    if t is None:
                        t = (
                            torch.full(shape, math.nan).to(dtype)
                            if dtype != torch.uint8
                            else torch.zeros(shape, dtype=dtype)
                        )
                    else:
                        loaded.add((f"{prefix}_{suffix}", e, SHARDS[p]))
                    per.append(t.reshape(shape))
                parts.append(torch.cat(per) if per[0].dim() else torch.stack(per).squeeze(0))
            params[f"{prefix}_{suffix}"] = torch.stack(parts)
    return params, loaded


def _drop(*names: str) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        for key in [k for k in t if k.startswith(tuple(f"{LAYER}.{n}" for n in names))]:
            del t[key]

    return edit


def _set(name: str, value: float, at: tuple[int, int] | None = None) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        key = f"{LAYER}.{name}"
        f = t[key].float().clone()
        if at is None:
            f.fill_(value)
        else:
            f[at] = value
        t[key] = f.to(t[key].dtype)

    return edit


def _zero_scale_over_data(name: str) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        packed, key = t[f"{LAYER}.{name}".rsplit(".", 1)[0] + ".weight"], f"{LAYER}.{name}"
        row, block = [int(i) for i in ((packed & 0x77).reshape(packed.shape[0], -1, 8).amax(-1) > 0).nonzero()[0]]
        f = t[key].float().clone()
        f[row, block] = 0.0
        t[key] = f.to(t[key].dtype)

    return edit


def _gate_up_differ(t: Tensors) -> None:
    t[f"{LAYER}.1.up_proj.weight_scale_2"] = t[f"{LAYER}.1.up_proj.weight_scale_2"] * 2


@dataclass(frozen=True)
class Case:
    why: str
    edit: Callable[[Tensors], None] | None
    tensor: str | None  # the tensor every consumer must name (under LAYER); None: clean
    message: str = ""
    severity: str = "error"
    convention: Convention = Convention.MODELOPT
    w4a4: bool = False


CT = Convention.COMPRESSED_TENSORS
CASES = [
    Case("clean ModelOpt", None, None),
    Case("clean compressed-tensors W4A4", None, None, convention=CT, w4a4=True),
    Case("missing expert", _drop("3."), "3", "missing"),
    Case("missing projection", _drop("1.up_proj."), "1.up_proj", "missing"),
    Case("missing weight_scale_2", _drop("2.gate_proj.weight_scale_2"), "2.gate_proj.weight_scale_2", "missing"),
    Case(
        "missing packed weight, CT",
        _drop("0.down_proj.weight_packed"),
        "0.down_proj.weight_packed",
        "missing",
        convention=CT,
    ),
    Case(
        "block scale 0 over non-zero codes",
        _zero_scale_over_data("0.down_proj.weight_scale"),
        "0.down_proj.weight_scale",
        "zero over non-zero codes",
    ),
    Case("NaN block scale", _set("2.up_proj.weight_scale", math.nan, (3, 1)), "2.up_proj.weight_scale", "NaN or inf"),
    Case(
        "negative block scale", _set("1.gate_proj.weight_scale", -1.0, (0, 0)), "1.gate_proj.weight_scale", "negative"
    ),
    Case(
        "inf global scale",
        _set("3.down_proj.weight_scale_2", math.inf),
        "3.down_proj.weight_scale_2",
        "finite and positive",
    ),
    Case(
        "negative global scale",
        _set("0.gate_proj.weight_scale_2", -2.0),
        "0.gate_proj.weight_scale_2",
        "finite and positive",
    ),
    Case("zero global scale", _set("0.up_proj.weight_scale_2", 0.0), "0.up_proj.weight_scale_2", "finite and positive"),
    Case(
        "CT global scale 1e-45 (its reciprocal is inf)",
        _set("1.up_proj.weight_global_scale", 1e-45),
        "1.up_proj.weight_global_scale",
        "as a multiplier",
        convention=CT,
    ),
    Case(
        "CT input scale 1e-45 (its reciprocal is inf)",
        _set("2.down_proj.input_global_scale", 1e-45),
        "2.down_proj.input_global_scale",
        "as a multiplier",
        convention=CT,
        w4a4=True,
    ),
    Case(
        "NaN input scale",
        _set("3.gate_proj.input_scale", math.nan),
        "3.gate_proj.input_scale",
        "finite and positive",
        w4a4=True,
    ),
    Case("W4A4 input scale missing", _drop("1.up_proj.input_scale"), "1.up_proj.input_scale", "missing", w4a4=True),
    Case(
        "one absurd W4A4 input scale (1e30)",
        _set("2.gate_proj.input_scale", 1e30),
        "2.gate_proj.input_scale",
        "median",
        w4a4=True,
    ),
    Case(
        "absurd CT input scale (stored 1e-30)",
        _set("0.down_proj.input_global_scale", 1e-30),
        "0.down_proj.input_global_scale",
        "median",
        convention=CT,
        w4a4=True,
    ),
    Case(
        "gate/up global scales differ",
        _gate_up_differ,
        "1.up_proj.weight_scale_2",
        "gate/up global scales differ",
        "warning",
    ),
]


def corrupted(gen: torch.Generator, case: Case) -> Tensors:
    tensors = build_layer(gen, case.convention, case.w4a4)
    if case.edit is not None:
        case.edit(tensors)
    return tensors


def _expected(case: Case) -> str:
    return f"{LAYER}.{case.tensor}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.why)
def test_inspect_and_converter_self_check_agree(gen, tmp_path, case):
    root = write_checkpoint(tmp_path / "ckpt", corrupted(gen, case), case.convention, case.w4a4)
    report = inspect_checkpoint(root)
    if case.tensor is None:
        assert not report.problems, [str(p) for p in report.problems]
        verify_output(root)
        assert main(["inspect", str(root)]) == 0
        return
    first = report.problems[0]
    assert (first.module, first.severity) == (_expected(case), case.severity), [str(p) for p in report.problems]
    assert case.message in first.message
    if case.severity == "warning":
        verify_output(root)  # the converter writes separate scales when asked: not an error
        assert main(["inspect", str(root)]) == 3
        return
    with pytest.raises(ConversionError) as info:
        verify_output(root)
    assert f"{_expected(case)}: " in str(info.value) and case.message in str(info.value)
    assert main(["inspect", str(root)]) == 1


@pytest.mark.vllm
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.why)
def test_vllm_loader_agrees(gen, case):
    from moe_nvfp4_vllm.loading import validate_loaded_experts

    params, loaded = loader_params(corrupted(gen, case), case.convention)
    check = lambda: validate_loaded_experts(
        LAYER,
        params,
        loaded,
        list(range(E)),
        case.convention,
        PROJ,  # noqa: E731
        require_input_scales=case.w4a4,
    )
    if case.tensor is None or case.severity == "warning":
        assert check() == case.w4a4
        return
    with pytest.raises(CheckpointError) as info:
        check()
    assert str(info.value).startswith(_expected(case) + " ") or str(info.value).startswith(_expected(case) + ":")
    assert case.message in str(info.value)


def test_input_scales_within_the_bound_pass(gen, tmp_path):
    """Experts calibrated 500x apart are legitimate (under the stated 1e3 bound): no outlier error."""
    tensors = build_layer(gen, Convention.MODELOPT, w4a4=True)
    tensors[f"{LAYER}.2.up_proj.input_scale"] = torch.tensor(0.01 * INPUT_SCALE_OUTLIER_RATIO / 2)
    report = inspect_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors, Convention.MODELOPT, True))
    assert not report.problems, [str(p) for p in report.problems]


def test_directory_without_nvfp4_is_an_error(gen, tmp_path):
    root = tmp_path / "bf16"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"hidden_size": H}))
    save_file({"model.embed_tokens.weight": torch.randn(8, H, generator=gen)}, str(root / "model.safetensors"))
    report = inspect_checkpoint(root)
    assert not report.ok and "no NVFP4 tensors" in report.problems[0].message
    assert main(["inspect", str(root)]) == 1


def _stacked(params: dict[str, torch.Tensor], need_input: bool, convention: Convention) -> dict:
    input_key = TENSOR_NAMES[convention][3]
    return {
        prefix: {
            name.removeprefix(prefix + "_"): t
            for name, t in params.items()
            if name.startswith(prefix + "_") and (need_input or not name.endswith(input_key))
        }
        for prefix in ("w13", "w2")
    }


def _per_expert(params: dict[str, torch.Tensor], convention: Convention, need_input: bool) -> dict:
    """The validator's input from stacked parameters, as the vLLM loader builds it."""
    out: dict = {}
    for prefix, tensors in _stacked(params, need_input, convention).items():
        projs = ("gate_proj", "up_proj") if prefix == "w13" else ("down_proj",)
        for suffix, t in tensors.items():
            for e in range(E):
                for part, proj in enumerate(projs):
                    x = t[e]
                    if prefix == "w13":
                        x = x[part] if x.dim() == 1 else x.chunk(len(projs), dim=0)[part]
                    out.setdefault(e, {}).setdefault(proj, {})[suffix] = x
    return out


def _has_error(params: dict[str, torch.Tensor], convention: Convention, need_input: bool) -> bool:
    findings = check_moe_layer(
        LAYER,
        _per_expert(params, convention, need_input),
        convention=convention,
        expected_experts=range(E),
        projections=PROJ,
        require_input_scales=need_input,
    )
    return any(f.severity == "error" for f in findings)


@pytest.mark.parametrize("case", [c for c in CASES if c.message != "missing"], ids=lambda c: c.why)
def test_stacked_screen_flags_every_value_error(gen, case):
    """The loader's one-sync screen says clean exactly where the per-expert validator finds no error."""
    params, _ = loader_params(corrupted(gen, case), case.convention)
    clean = stacked_layer_clean(
        _stacked(params, case.w4a4, case.convention), convention=case.convention, need_input=case.w4a4
    )
    assert clean == (case.tensor is None or case.severity == "warning")
    assert clean == (not _has_error(params, case.convention, case.w4a4))


# e4m3 bytes: NaN (0x7F, 0xFF), negatives, zeros (+0, -0: lost blocks over non-zero codes), normal values
SCALE_BYTES = (0x7F, 0xFF, 0x81, 0xB8, 0xFE, 0x00, 0x80, 0x38, 0x01)
SCALARS = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 1e-30, 1e30, 3.0)


@pytest.mark.parametrize("convention", list(Convention))
def test_stacked_screen_agrees_on_random_corruptions(gen, convention):
    """Random single and double corruptions of stacked parameters (scale bytes, packed codes, every scalar, input
    scales around the outlier bound): the screen and the per-expert validator give the same verdict each time."""
    base, _ = loader_params(build_layer(gen, convention, w4a4=True), convention)
    input_key = TENSOR_NAMES[convention][3]
    verdicts = set()
    for trial in range(60):
        params = {k: v.clone() for k, v in base.items()}
        for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
            name = list(params)[int(torch.randint(len(params), (1,), generator=gen))]
            t = params[name]
            flat = t.view(torch.uint8).reshape(-1) if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t.reshape(-1)
            at = int(torch.randint(flat.numel(), (1,), generator=gen))
            if t.dtype == torch.float8_e4m3fn:
                flat[at] = SCALE_BYTES[int(torch.randint(len(SCALE_BYTES), (1,), generator=gen))]
            elif t.dtype == torch.uint8:
                flat[at] = int(torch.randint(256, (1,), generator=gen))
            elif name.endswith(input_key) and trial % 3 == 0:  # near the outlier bound, either side
                ratio = INPUT_SCALE_OUTLIER_RATIO * float(torch.empty(1).uniform_(0.5, 4.0, generator=gen))
                flat[at] = flat.median() / ratio if convention is CT else flat.median() * ratio
            else:
                flat[at] = SCALARS[int(torch.randint(len(SCALARS), (1,), generator=gen))]
        need_input = bool(trial % 2)
        clean = stacked_layer_clean(
            _stacked(params, need_input, convention), convention=convention, need_input=need_input
        )
        assert clean == (not _has_error(params, convention, need_input)), trial
        verdicts.add(clean)
    assert verdicts == {True, False}  # both verdicts were exercised
