"""The vLLM plugin's quantization-config parsing against hostile configs (issue 54): every config either parses or
raises ``QuantConfigError`` (a ValueError) whose ``field`` names a field of the config, never another exception.

Property tests (Hypothesis, bounded: a few hundred examples, seconds): valid ModelOpt / hf_quant_config.json /
compressed-tensors configs with one field replaced by a random JSON value, an odd string ("16.0", "re:((", "")
or deleted, and wholly random JSON.  The check itself needs no vLLM; the same configs through
``NVFP4GroupedConfig.from_config`` (vLLM's own parsers behind it) are tested in test_vllm_plugin.py, which CI
runs under each supported vLLM release.

Tolerances: none (parsing only).
"""

from __future__ import annotations

import copy
import re
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_nvfp4.convert.quant_config import QuantConfigError, check_quantization_config

EXAMPLES = 300  # the check alone: about 1 ms an example
EXAMPLES_VLLM = 80  # through vLLM's parsers (test_vllm_plugin.py): about 10 ms an example

FP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
}
MODELOPT = {
    "quant_method": "modelopt",
    "quant_algo": "W4A16_NVFP4",
    "group_size": 16,
    "kv_cache_scheme": None,
    "ignore": ["lm_head", "re:.*mlp\\.gate$"],
    "producer": {"name": "moe_nvfp4", "version": "0.1.0"},
}
HF_QUANT = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quant_method": "modelopt_fp4",
    "quantization": {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    },
}
CT = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": dict(FP4),
            "format": "nvfp4-pack-quantized",
            "input_activations": {**FP4, "dynamic": "local"},
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
}
VALID = [MODELOPT, HF_QUANT, CT]

keys = st.text(string.ascii_letters + "_", min_size=1, max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=8,
)
odd_values = st.sampled_from(
    [
        "16.0",
        "16",
        "",
        "re:((",
        "re:[a",
        "re:",
        "re:*x",
        16.0,
        True,
        [],
        {},
        None,
        [None],
        ["re:(("],
        {"targets": "Linear"},
        [["Linear"]],
        2**63,
    ]
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON object (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def configs(draw: st.DrawFn) -> Any:
    """A valid config with one to three fields replaced, deleted or added; sometimes wholly random JSON."""
    if draw(st.integers(0, 7)) == 0:
        return draw(json_values)
    cfg = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(cfg)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = cfg
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "odd", "odd", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(keys)] = copy.deepcopy(draw(json_values | odd_values))  # odd_values' objects are shared
        else:
            parent[path[-1]] = copy.deepcopy(draw(odd_values if action == "odd" else json_values))
    return cfg


def _field_exists(cfg: Any, field: str) -> bool:
    """Whether the error's field path leads into ``cfg`` (its last step may be the missing key it names)."""
    steps = re.findall(r"\[(\d+)\]|([^.\[\]]+)", field)
    node = cfg
    for i, (index, key) in enumerate(steps):
        last = i == len(steps) - 1
        if index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        elif key and isinstance(node, dict) and (key in node or last):
            node = node.get(key)
        else:
            return False
    return True


def assert_names_a_field(cfg: Any, e: QuantConfigError) -> None:
    assert str(e).startswith("quantization_config"), str(e)
    assert _field_exists(cfg, e.field), f"field {e.field!r} is not in the config: {e}"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_check_raises_only_quant_config_error_naming_the_field(cfg):
    try:
        check_quantization_config(cfg)
    except QuantConfigError as e:
        assert_names_a_field(cfg, e)


# (why, config, the field the error must name); each of these crashed with a raw exception before issue 54
BAD_CONFIGS = [
    ("a list", [MODELOPT], ""),
    ("a string", "modelopt", ""),
    ("config_groups as a list", {**CT, "config_groups": [CT["config_groups"]["group_0"]]}, "config_groups"),
    (
        "a group without targets",
        {**CT, "config_groups": {"group_0": {"weights": FP4}}},
        "config_groups.group_0.targets",
    ),
    (
        "targets a string",
        {**CT, "config_groups": {"group_0": {"targets": "Linear", "weights": FP4}}},
        "config_groups.group_0.targets",
    ),
    ("group_size '16.0'", {**MODELOPT, "group_size": "16.0"}, "group_size"),
    (
        "group_size 32 in hf_quant_config.json",
        {**HF_QUANT, "quantization": {**HF_QUANT["quantization"], "group_size": 32}},
        "quantization.group_size",
    ),
    ("a bad re: pattern in ignore", {**CT, "ignore": ["lm_head", "re:(("]}, "ignore[1]"),
    (
        "a bad re: target",
        {**CT, "config_groups": {"group_0": {"targets": ["re:[a"], "weights": FP4}}},
        "config_groups.group_0.targets[0]",
    ),
    (
        "num_bits a string",
        {**CT, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**FP4, "num_bits": "4"}}}},
        "config_groups.group_0.weights.num_bits",
    ),
    ("quant_algo a number", {**MODELOPT, "quant_algo": 4}, "quant_algo"),
    (
        "exclude_modules a string",
        {**HF_QUANT, "quantization": {**HF_QUANT["quantization"], "exclude_modules": "lm_head"}},
        "quantization.exclude_modules",
    ),
]


@pytest.mark.parametrize("why, cfg, field", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_field(why, cfg, field):
    with pytest.raises(QuantConfigError) as info:
        check_quantization_config(cfg)
    assert info.value.field == field, str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("cfg", VALID, ids=["modelopt", "hf_quant_config", "compressed-tensors"])
def test_valid_configs_pass(cfg):
    check_quantization_config(copy.deepcopy(cfg))
