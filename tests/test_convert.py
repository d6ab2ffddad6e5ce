"""Offline converter: tiny random Mixtral / Qwen3-MoE / NemotronH / Llama-4 / gpt-oss checkpoints made with transformers,
converted to NVFP4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers_checkpoints import EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, LAYERS, make_tiny_checkpoint, tiny_config
from moe_nvfp4.checkpoint import Convention
from moe_nvfp4.cli import main
from moe_nvfp4.convert import (
    ConversionError,
    ConvertOptions,
    QuantSettings,
    Selection,
    convert_checkpoint,
    inspect_checkpoint,
)
from moe_nvfp4.formats import NVFP4, NVFP4Tensor, dequantize_nvfp4

# Quantizer bound per element: half the widest e2m1 gap (1.0, between 4 and 6) times the block's scale,
# plus whatever saturates past 6 * scale after the e4m3 rounding of the block scale.
HALF_WIDEST_GAP = 1.0
# Relative Frobenius error of NVFP4 on Gaussian-like weights is ~0.09-0.10; anything above this is a bug.
MAX_RELATIVE_ERROR = 0.12

EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}
STACKED_NAMES = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(family, stacked) -> a 3-shard tiny checkpoint."""
    root = tmp_path_factory.mktemp("src")
    return {
        (family, stacked): make_tiny_checkpoint(family, root / f"{family}-{stacked}", shards=3, stacked=stacked)
        for family in ("mixtral", "qwen3_moe")
        for stacked in (False, True)
    }


def read_all(root: Path) -> dict[str, torch.Tensor]:
    if not (root / "model.safetensors.index.json").exists():
        return load_file(str(root / "model.safetensors"))  # a single-file source
    index = json.loads((root / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(root / shard)))
    assert set(out) == set(index["weight_map"]), "index and shards disagree"
    return out


def source_expert(src: dict[str, torch.Tensor], family: str, stacked: bool, layer: int, e: int, i: int) -> torch.Tensor:
    """The source [N, K] weight of projection i (0 gate, 1 up, 2 down) of expert e."""
    if stacked:
        if i == 2:
            return src[f"model.layers.{layer}.mlp.experts.down_proj"][e]
        return src[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].chunk(2)[i]
    prefix, projs = EXPERT_NAMES[family]
    return src[f"model.layers.{layer}.{prefix}.{e}.{projs[i]}.weight"]


def assert_within_bound(w: torch.Tensor, q: NVFP4Tensor, what: str) -> None:
    wf = w.float()
    scale = (q.block_scale.float() * q.global_scale.float()).repeat_interleave(NVFP4.block_size, dim=-1)
    block_amax = (
        wf.abs().reshape(*wf.shape[:-1], -1, NVFP4.block_size).amax(-1).repeat_interleave(NVFP4.block_size, dim=-1)
    )
    bound = HALF_WIDEST_GAP * scale + (block_amax - NVFP4.value_max * scale).clamp(min=0)
    err = (dequantize_nvfp4(q) - wf).abs()
    assert bool((err <= bound * (1 + 1e-6)).all()), f"{what}: error {float((err - bound).max())} past the bound"
    rel = float(torch.linalg.vector_norm(dequantize_nvfp4(q) - wf) / torch.linalg.vector_norm(wf))
    assert rel < MAX_RELATIVE_ERROR, f"{what}: relative error {rel}"


def modelopt_tensor(out: dict[str, torch.Tensor], module: str) -> NVFP4Tensor:
    return NVFP4Tensor(out[f"{module}.weight"], out[f"{module}.weight_scale"], out[f"{module}.weight_scale_2"])


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_converts_experts_within_bound(sources, tmp_path, family, stacked):
    src_dir = sources[(family, stacked)]
    summary = convert_checkpoint(src_dir, tmp_path / "out", progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    prefix, projs = STACKED_NAMES if stacked else EXPERT_NAMES[family]
    assert summary.quantized_modules == LAYERS * EXPERTS * 3
    assert summary.worst_relative_error < MAX_RELATIVE_ERROR
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            modules = [f"model.layers.{layer}.{prefix}.{e}.{p}" for p in projs]
            for i, module in enumerate(modules):
                q = modelopt_tensor(out, module)
                assert q.packed.dtype == torch.uint8 and q.block_scale.dtype == torch.float8_e4m3fn
                assert q.global_scale.dtype == torch.float32 and q.global_scale.dim() == 0
                assert f"{module}.input_scale" not in out, "weight-only conversion writes no input scale"
                assert_within_bound(source_expert(src, family, stacked, layer, e, i), q, module)
            assert out[f"{modules[0]}.weight_scale_2"] == out[f"{modules[1]}.weight_scale_2"], "gate/up share one scale"
    copied = [n for n in src if "experts" not in n]
    assert all(torch.equal(src[n], out[n]) and src[n].dtype == out[n].dtype for n in copied)
    assert not any("experts" in n and n not in out for n in copied)
    assert inspect_checkpoint(tmp_path / "out").ok


def test_config_and_files(sources, tmp_path):
    src_dir = sources[("qwen3_moe", False)]
    convert_checkpoint(src_dir, tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "W4A16_NVFP4", 16)
    assert qc["moe_nvfp4"]["format_version"] == NVFP4.version
    assert qc["moe_nvfp4"]["scale_layout"] == "linear"
    assert qc["moe_nvfp4"]["gate_up_global_scale"] == "shared_max"
    assert "lm_head" in qc["ignore"] and "model.layers.0.self_attn.q_proj" in qc["ignore"]
    assert "model.layers.0.mlp.gate" in qc["ignore"]
    assert not any("experts" in m for m in qc["ignore"])
    hf = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert hf["quantization"]["exclude_modules"] == qc["ignore"] and "kv_cache_quant_algo" in hf["quantization"]
    assert (tmp_path / "out" / "generation_config.json").read_text() == (src_dir / "generation_config.json").read_text()
    with safe_open(str(next((tmp_path / "out").glob("model-*.safetensors"))), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_output_matches_single_shard(sources, tmp_path):
    src_dir = sources[("mixtral", False)]
    convert_checkpoint(src_dir, tmp_path / "one", progress=False)
    convert_checkpoint(src_dir, tmp_path / "many", ConvertOptions(max_shard_bytes=40_000), progress=False)
    assert len(list((tmp_path / "many").glob("model-*-of-*.safetensors"))) > 3
    one, many = read_all(tmp_path / "one"), read_all(tmp_path / "many")
    assert one.keys() == many.keys() and all(
        torch.equal(one[k].view(torch.uint8), many[k].view(torch.uint8)) for k in one if one[k].dim()
    )


def test_deterministic_bytes(sources, tmp_path):
    src_dir = sources[("qwen3_moe", True)]
    for name in ("a", "b"):
        convert_checkpoint(src_dir, tmp_path / name, progress=False)
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert files and all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


@pytest.mark.gpu
def test_cuda_bytes_match_cpu(sources, tmp_path):
    src_dir = sources[("mixtral", False)]
    convert_checkpoint(src_dir, tmp_path / "cpu", progress=False)
    convert_checkpoint(src_dir, tmp_path / "cuda", ConvertOptions(device="cuda"), progress=False)
    cpu, cuda = read_all(tmp_path / "cpu"), read_all(tmp_path / "cuda")
    assert sorted(cpu) == sorted(cuda)
    for name in sorted(cpu):
        a, b = cpu[name], cuda[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        differ = (a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum().item()
        assert differ == 0, (
            f"{name}: {differ} bytes differ between CPU and CUDA, e.g. {a.flatten()[:4]} vs {b.flatten()[:4]}"
        )
    files = sorted(p.name for p in (tmp_path / "cpu").glob("*.safetensors"))
    assert all((tmp_path / "cpu" / f).read_bytes() == (tmp_path / "cuda" / f).read_bytes() for f in files)


def test_separate_gate_up_scales_are_exact(sources, tmp_path):
    src_dir = sources[("qwen3_moe", False)]
    options = ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True))
    convert_checkpoint(src_dir, tmp_path / "out", options, progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    for proj in ("gate_proj", "up_proj"):
        module = f"model.layers.1.mlp.experts.2.{proj}"
        amax = src[f"{module}.weight"].float().abs().max()
        assert float(out[f"{module}.weight_scale_2"]) == float(amax / (6 * 448))
    meta = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["moe_nvfp4"]
    assert meta["gate_up_global_scale"] == "separate"
    assert inspect_checkpoint(tmp_path / "out").ok, "declared separate scales are a warning, not an error"


def test_all_linear(sources, tmp_path):
    src_dir = sources[("qwen3_moe", False)]
    convert_checkpoint(src_dir, tmp_path / "out", ConvertOptions(selection=Selection(all_linear=True)), progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module = f"model.layers.0.self_attn.{proj}"
        assert_within_bound(src[f"{module}.weight"], modelopt_tensor(out, module), module)
    for kept in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert out[kept].dtype == torch.bfloat16, f"{kept} must stay unquantized"
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_include_and_exclude(sources, tmp_path):
    src_dir = sources[("mixtral", False)]
    only_q = ConvertOptions(selection=Selection(include=(r"self_attn\.q_proj",)))
    convert_checkpoint(src_dir, tmp_path / "q", only_q, progress=False)
    out = read_all(tmp_path / "q")
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert out["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.block_sparse_moe.experts" in ignore and "model.layers.0.self_attn.q_proj" not in ignore

    no_layer1 = ConvertOptions(selection=Selection(exclude=(r"layers\.1\.",)))
    convert_checkpoint(src_dir, tmp_path / "x", no_layer1, progress=False)
    out = read_all(tmp_path / "x")
    assert out["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.uint8

    one_expert = ConvertOptions(selection=Selection(exclude=(r"experts\.2\.",)))
    with pytest.raises(ConversionError, match="must be quantized whole"):
        convert_checkpoint(src_dir, tmp_path / "partial", one_expert, progress=False)
    assert not (tmp_path / "partial").exists()


def test_compressed_tensors_output(sources, tmp_path):
    src_dir = sources[("qwen3_moe", False)]
    options = ConvertOptions(settings=QuantSettings(convention=Convention.COMPRESSED_TENSORS))
    convert_checkpoint(src_dir, tmp_path / "out", options, progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    module = "model.layers.0.mlp.experts.1.down_proj"
    q = NVFP4Tensor(
        out[f"{module}.weight_packed"], out[f"{module}.weight_scale"], 1.0 / out[f"{module}.weight_global_scale"]
    )
    assert_within_bound(src[f"{module}.weight"], q, module)
    assert f"{module}.weight" not in out and not (tmp_path / "out" / "hf_quant_config.json").exists()
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    report = inspect_checkpoint(tmp_path / "out")
    assert report.ok and report.conventions == ("compressed-tensors",)


def test_w4a4_input_scale_rule(sources, tmp_path):
    options = ConvertOptions(settings=QuantSettings(input_amax=448.0))
    convert_checkpoint(sources[("mixtral", True)], tmp_path / "out", options, progress=False)
    out = read_all(tmp_path / "out")
    scales = [t for n, t in out.items() if n.endswith(".input_scale")]
    assert len(scales) == LAYERS * EXPERTS * 3 and all(float(s) == pytest.approx(448.0 / 2688) for s in scales)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "NVFP4" and "448.0" in qc["moe_nvfp4"]["input_scale"]
    assert inspect_checkpoint(tmp_path / "out").ok


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _first_expert_shard(root: Path) -> tuple[Path, str]:
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in sorted(index) if ".experts." in n)
    return root / index[name], name


def _truncate(root: Path) -> None:
    shard, _ = _first_expert_shard(root)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def _rewrite_expert(root: Path, fn) -> None:
    shard, name = _first_expert_shard(root)
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _nan(root: Path) -> None:
    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[0, 3] = float("nan")
        return t

    _rewrite_expert(root, poison)


def _rename_experts(root: Path) -> None:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {n.replace("experts", "ffn_bank"): t for n, t in load_file(str(root / shard)).items()}
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index["weight_map"] = {n.replace("experts", "ffn_bank"): s for n, s in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


# (corruption, what the error must say)
CORRUPTIONS = {
    "truncated-shard": (_truncate, "truncated or corrupt"),
    "wrong-dtype": (lambda root: _rewrite_expert(root, lambda t: t.to(torch.int8)), "dtype I8, expected"),
    "nan-weights": (_nan, "1 NaN/inf values"),
    "no-experts": (_rename_experts, "no routed expert weights recognised"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_input_fails_cleanly(sources, tmp_path, case):
    corrupt, message = CORRUPTIONS[case]
    src_dir = _copy(sources[("mixtral", False)], tmp_path / "src")
    corrupt(src_dir)
    dst = tmp_path / "out" / "model"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(src_dir, dst, progress=False)
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir()), "temp output left behind"


def test_existing_output_is_refused(sources, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(sources[("mixtral", False)], tmp_path / "out", progress=False)


def test_cli_convert(sources, tmp_path, capsys):
    src_dir = sources[("qwen3_moe", False)]
    assert main(["convert", str(src_dir), str(tmp_path / "out"), "--quiet", "--max-shard-size", "100KB"]) == 0
    assert "quantized modules: 24" in capsys.readouterr().out
    assert main(["convert", str(src_dir), str(tmp_path / "out"), "--quiet"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "out")]) == 0


# ---------------------------------------------------------------- NemotronH, Llama-4, gpt-oss


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_checkpoint(f, root / f) for f in ("nemotron_h", "llama4_text", "gpt_oss")}


@pytest.mark.parametrize("convention", [Convention.MODELOPT, Convention.COMPRESSED_TENSORS], ids=["modelopt", "ct"])
def test_nemotron_h_non_gated_experts(family_sources, tmp_path, convention):
    """NemotronH's experts are up_proj + down_proj (ReLU², no gate), per expert under backbone.layers.N.mixer: each
    is quantized on its own, the shared expert, Mamba-free attention and the router stay BF16."""
    src_dir = family_sources["nemotron_h"]
    options = ConvertOptions(settings=QuantSettings(convention=convention))
    summary = convert_checkpoint(src_dir, tmp_path / "out", options, progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    moe_layers = [n for n, kind in enumerate(tiny_config("nemotron_h").layers_block_type) if kind == "moe"]
    assert summary.quantized_modules == len(moe_layers) * EXPERTS * 2
    names = (
        ("weight_packed", "weight_scale", "weight_global_scale")
        if convention is Convention.COMPRESSED_TENSORS
        else ("weight", "weight_scale", "weight_scale_2")
    )
    for layer in moe_layers:
        for e in range(EXPERTS):
            for proj in ("up_proj", "down_proj"):
                module = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}"
                gs = out[f"{module}.{names[2]}"]
                q = NVFP4Tensor(
                    out[f"{module}.{names[0]}"],
                    out[f"{module}.{names[1]}"],
                    1.0 / gs if convention is Convention.COMPRESSED_TENSORS else gs,
                )
                assert_within_bound(src[f"{module}.weight"], q, module)
            assert not any(".gate_proj" in n for n in out)
        shared = f"backbone.layers.{layer}.mixer.shared_experts.up_proj.weight"
        assert torch.equal(out[shared], src[shared])
    report = inspect_checkpoint(tmp_path / "out")
    assert report.ok and report.shapes == {"up": (EXPERT_INTERMEDIATE, HIDDEN), "down": (HIDDEN, EXPERT_INTERMEDIATE)}


def _edit(src: Path, dst: Path, fn) -> Path:
    """A copy of the checkpoint ``src`` whose tensors ``fn`` rewrote (a dict in, a dict out)."""
    dst = _copy(src, dst)
    save_file(fn(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_nemotron_h_expert_with_a_gate_or_without_up_is_refused(family_sources, tmp_path):
    src_dir = family_sources["nemotron_h"]
    expert = "backbone.layers.1.mixer.experts.2"
    gated = _edit(
        src_dir,
        tmp_path / "gated",
        lambda t: {**t, f"{expert}.gate_proj.weight": t[f"{expert}.up_proj.weight"].clone()},
    )
    with pytest.raises(
        ConversionError, match=rf"{expert}: {expert}.gate_proj.weight: model_type nemotron_h has non-gated"
    ):
        convert_checkpoint(gated, tmp_path / "out", progress=False)
    no_up = _edit(
        src_dir, tmp_path / "no-up", lambda t: {k: v for k, v in t.items() if k != f"{expert}.up_proj.weight"}
    )
    with pytest.raises(ConversionError, match=rf"{expert}: expert has no \['up'\] projection"):
        convert_checkpoint(no_up, tmp_path / "out", progress=False)


def test_llama4_stacked_transposed_experts(family_sources, tmp_path):
    """Llama-4 text stores experts stacked and transposed, gate_up_proj [E, H, 2I] (gate columns first) and
    down_proj [E, I, H]; the config's sizes give the orientation.  Written per expert under the names vLLM's
    Llama-4 loader (and ModelOpt's own Llama-4 FP4 checkpoints) use; the shared expert and router stay BF16."""
    src_dir = family_sources["llama4_text"]
    convert_checkpoint(src_dir, tmp_path / "out", progress=False)
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.feed_forward.experts"
        gate_up, down = src[f"{prefix}.gate_up_proj"], src[f"{prefix}.down_proj"]
        assert gate_up.shape == (EXPERTS, HIDDEN, 2 * EXPERT_INTERMEDIATE) and f"{prefix}.gate_up_proj" not in out
        for e in range(EXPERTS):
            gate, up = gate_up[e].T.chunk(2)
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down[e].T)):
                assert_within_bound(w, modelopt_tensor(out, f"{prefix}.{e}.{proj}"), f"{prefix}.{e}.{proj}")
        shared = f"model.layers.{layer}.feed_forward.shared_expert.gate_proj"
        assert torch.equal(out[f"{shared}.weight"], src[f"{shared}.weight"])
        ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
        assert {shared, f"model.layers.{layer}.feed_forward.router"} <= set(ignore)
    assert inspect_checkpoint(tmp_path / "out").ok


def test_gpt_oss_is_refused_with_the_reason(family_sources, tmp_path):
    with pytest.raises(
        ConversionError,
        match=r"mlp.experts.*vLLM \(0.26, 0.33\) loads gpt-oss experts only as BF16.*"
        r"--quantization nvfp4_grouped",
    ):
        convert_checkpoint(family_sources["gpt_oss"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
def test_vllm_accepts_configs(sources, tmp_path):
    modelopt = pytest.importorskip("vllm.model_executor.layers.quantization.modelopt")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    src_dir = sources[("qwen3_moe", False)]
    convert_checkpoint(src_dir, tmp_path / "mo", progress=False)
    qc = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert modelopt.ModelOptFp8Config.override_quantization_method(qc, None) is None
    assert modelopt.ModelOptNvFp4Config.override_quantization_method(qc, None) == "modelopt_fp4"
    hf = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert modelopt.ModelOptNvFp4Config.get_config_filenames() == ["hf_quant_config.json"]
    for cfg in (qc, hf):
        parsed = modelopt.ModelOptNvFp4Config.from_config(cfg)
        assert parsed.is_checkpoint_nvfp4_serialized and parsed.quant_method == "W4A16_NVFP4"
        assert parsed.group_size == 16 and parsed.exclude_modules == qc["ignore"]
        assert parsed.is_layer_excluded("model.layers.0.self_attn.q_proj")
        assert not parsed.is_layer_excluded("model.layers.0.mlp.experts")

    options = ConvertOptions(settings=QuantSettings(convention=Convention.COMPRESSED_TENSORS, input_amax=100.0))
    convert_checkpoint(src_dir, tmp_path / "ct", options, progress=False)
    ct = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    parsed = CompressedTensorsConfig.from_config(ct)
    scheme = parsed.target_scheme_map["Linear"]
    assert CompressedTensorsConfig._is_nvfp4_format(scheme["weights"])
    assert CompressedTensorsConfig._is_nvfp4_format(scheme["input_activations"])
