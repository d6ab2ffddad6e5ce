"""Fuzzing convert and inspect with hostile safetensors headers and config/index JSON (Hypothesis, bounded:
about 40 examples a test, well under 60 s in all): the only exceptions that may come out are the project's
named errors (ConversionError; inspect turns CheckpointError into reported problems).

Tolerances: none.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_nvfp4.convert import ConversionError, convert_checkpoint, inspect_checkpoint

EXAMPLES = 40

L = "model.layers.0.mlp.experts"
NAMES = [
    f"{L}.0.gate_proj.weight",
    f"{L}.0.up_proj.weight",
    f"{L}.0.down_proj.weight",
    f"{L}.gate_up_proj",
    f"{L}.down_proj",
    f"{L}.0.gate_proj.weight_scale",
    f"{L}.0.gate_proj.weight_scale_2",
    f"{L}.0.up_proj.input_scale",
    f"{L}.0.down_proj.weight_packed",
    f"{L}.0.down_proj.weight_global_scale",
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "lm_head.weight",
]
DTYPES = {
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "BOOL": 1,
    "F64": 8,
    "U16": 2,
    "I32": 4,
    "F4": 1,
    "XYZ": 1,
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
sizes = st.integers(-2, 80) | st.sampled_from([0, 16, 32, 64, 2**40])
plausible_config = st.fixed_dictionaries(
    {"hidden_size": st.sampled_from([32, 32, 64]) | sizes, "intermediate_size": st.sampled_from([16, 16, 32]) | sizes},
    optional={"num_local_experts": st.integers(-1, 4), "model_type": st.sampled_from(["mixtral", "gpt_oss"])},
)
configs = (
    plausible_config
    | plausible_config
    | json_values
    | st.fixed_dictionaries(
        {},
        optional={
            "hidden_size": sizes | json_values,
            "intermediate_size": sizes,
            "moe_intermediate_size": sizes,
            "num_local_experts": sizes | json_values,
            "model_type": st.sampled_from(["mixtral", "gpt_oss", "llama4"]) | json_values,
            "text_config": json_values,
            "quantization_config": json_values
            | st.fixed_dictionaries(
                {"quant_method": st.sampled_from(["modelopt", "compressed-tensors"]) | json_values},
                optional={"quant_algo": json_values, "config_groups": json_values, "moe_nvfp4": json_values},
            ),
        },
    )
)


@st.composite
def shard_bytes(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    """A safetensors file and its tensor names: mostly well-formed headers with odd dtypes and shapes,
    sometimes broken offsets, lengths or JSON, sometimes raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64)), []
    header: dict[str, object] = {}
    offset = 0
    coherent = draw(st.booleans())  # one BF16 expert that fits the plausible config (H 32, I 16): reaches quantization
    names = NAMES[:3] if coherent else draw(st.lists(st.sampled_from(NAMES), max_size=5, unique=True))
    for name in names:
        if coherent:
            dtype, shape = "BF16", [32, 16] if "down" in name else [16, 32]
        else:
            dtype = draw(st.sampled_from(["BF16", "BF16", "F32", "U8", "F8_E4M3"]) | st.sampled_from(sorted(DTYPES)))
            shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 16, 32]), max_size=3))
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        end = offset + n + draw(st.sampled_from([0] * 12 + [1, -1]))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = max(offset, end)
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=4), st.text(max_size=4) | json_values, max_size=2)
        )
    text = json.dumps(header).encode()
    if draw(st.integers(0, 19)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    length = len(text) + draw(st.sampled_from([0] * 12 + [3, -3, 2**40]))
    data = draw(st.binary(min_size=offset, max_size=offset)) if offset <= 8192 else b""
    return struct.pack("<Q", max(length, 0)) + text + data, names


@st.composite
def checkpoints(draw: st.DrawFn) -> dict[str, bytes]:
    files = {"config.json": json.dumps(draw(configs)).encode()}
    shards = draw(st.lists(shard_bytes(), min_size=1, max_size=2))
    if len(shards) == 1 and draw(st.booleans()):
        files["model.safetensors"] = shards[0][0]
        return files
    shard_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    files.update({name: data for name, (data, _) in zip(shard_names, shards)})
    weight_map = {t: name for name, (_, tensors) in zip(shard_names, shards) for t in tensors}  # as written
    kind = draw(st.sampled_from(["as written", "as written", "drawn", "raw"]))
    if kind == "drawn":
        weight_map = draw(
            st.dictionaries(st.sampled_from(NAMES), st.sampled_from(shard_names) | json_values, max_size=6)
        )
    obj = {"weight_map": weight_map} if kind != "raw" else draw(json_values)
    files["model.safetensors.index.json"] = json.dumps(obj).encode()
    return files


def _write(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


@settings(max_examples=EXAMPLES)
@given(checkpoints())
def test_convert_raises_only_conversion_error(files):
    with tempfile.TemporaryDirectory() as tmp:
        src = _write(Path(tmp) / "src", files)
        try:
            convert_checkpoint(src, Path(tmp) / "out", progress=False)
        except ConversionError:
            assert not (Path(tmp) / "out").exists()


@settings(max_examples=EXAMPLES)
@given(checkpoints())
def test_inspect_raises_only_conversion_error(files):
    with tempfile.TemporaryDirectory() as tmp:
        src = _write(Path(tmp) / "src", files)
        try:
            report = inspect_checkpoint(src)
        except ConversionError:
            return
        assert report.ok == (report.exit_code in (0, 3))
