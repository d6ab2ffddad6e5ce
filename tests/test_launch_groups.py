"""The sm_90 host's kernel launches, recorded on CPU and compared with a golden record (issue 41 item 3): grouping the
host's launch arguments (weights, routing, config) must not change any kernel's grid, positional or keyword
argument.  No kernel runs: the launch objects of the GEMMs (Triton and Gluon), the routing and the combine kernels are
replaced by recorders, and ``fused_moe_sm90`` runs on small CPU tensors (the Gluon GEMMs reached by declaring the rows
16-byte aligned, as a GPU would find them; programmatic dependent launch declared on where a case says so).

Each argument is recorded by what the kernel can tell of it: a tensor by which named input it is (a view of it, or a
buffer the host allocated, numbered by first use), its storage offset, shape, stride and dtype; a TMA descriptor by
its base tensor, shape, strides, block shape and layout; a tuple item by item; a scalar by value and type.  The golden
file was written by this module's ``--write`` on the code before the launch groups (main at 891f650), then again
when the epilogue tuple gained GATE_UP (2026-11-28; every launch the same but that field), and when the router weights
moved from GEMM2 to the combine (2026-11-30: the GEMMs lost their weights argument and the epilogue's ROUTER_WEIGHT,
the combine gained the weights and WEIGHTED; every other argument the same), and when GEMM2 on the Triton kernel took
TMA descriptors (branch gemm2-tma, 2026-11-30: the Triton GEMM's token-row descriptors, one per token width, and two
weight descriptors, None where it reads through addresses, and TMA; every other argument the same):

    python tests/test_launch_groups.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor as TritonTensorDescriptor

import moe_nvfp4 as m
from moe_nvfp4.sm90 import default_config as C
from moe_nvfp4.sm90.configs import GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90 import gemm_gluon as W
from moe_nvfp4.sm90 import gemm_triton as G
from moe_nvfp4.sm90 import host as K
from moe_nvfp4.triton import combine as combine_module
from moe_nvfp4.triton import common as triton_common
from moe_nvfp4.triton import routing_kernels as R

GOLDEN = Path(__file__).with_name("launch_groups_golden.json")
E = 8  # experts (local ones; an expert map has 10 global ones)
# the recorded launch objects: (module, attribute)
KERNELS = [
    (G, "_moe_gemm_kernel"),
    (W, "_moe_gemm_ws_kernel"),
    (R, "_route_kernel"),
    (R, "_count_kernel"),
    (combine_module, "_combine_kernel"),
]


H, I = 256, 128  # noqa: E741  hidden and intermediate of most cases: K of two and one 128-wide chunks
# K and N not whole chunks (padded to 256 and 128: k != kp), x's rows 48 elements apart from its last column
ODD = dict(hidden=208, intermediate=80, row_pad=48)


def _ws(preset: dict, k: int, block_m: int, gated: bool, **fields) -> GemmConfig:
    return C.fit_gemm(preset, k, block_m, gated, **fields)


def _cases() -> dict[str, dict]:
    """name -> (config or None for select_config's, tokens, top_k, expert map, variant, Gluon rows, PDL, x dtype):
    every kernel family the configs choose, the expert-MLP variants of issue 42, and the host's other branches."""
    k_groups = MoEKernelConfig(
        8,
        _ws(C.WS_K_GROUPS, H, 8, True, loader_warps=2),
        _ws(C.WS_K_GROUPS, I, 8, False, loader_warps=2),
        partials_in_x_dtype=True,
        pair_tiles=True,
    )
    pairs = MoEKernelConfig(
        8, _ws(C.WS_DECODE, H, 8, True, loader_warps=2), _ws(C.WS_DECODE, I, 8, False, loader_warps=2), pair_tiles=True
    )
    decode8 = MoEKernelConfig(
        8,
        _ws(C.WS_DECODE_DEEP, H, 8, True, loader_warps=2),
        _ws(C.WS_DECODE, I, 8, False, loader_warps=2, block_n=C.DECODE_GEMM2_BLOCK_N),
    )
    narrow16 = MoEKernelConfig(
        16, _ws(C.WS_DECODE_WIDE, H, 16, True, narrow_tiles=1), _ws(C.WS_DECODE_WIDE, I, 16, False, narrow_tiles=1)
    )
    two_groups32 = MoEKernelConfig(
        32,
        _ws(C.WS_TWO_GROUPS, H, 32, True, narrow_tiles=1),
        _ws(C.WS_ONE_GROUP, I, 32, False, narrow_tiles=1),
        partials_in_x_dtype=True,
    )
    mixed64 = MoEKernelConfig(
        64,
        _ws(C.WS_TWO_GROUPS, H, 64, True, narrow_tiles=2),
        _ws(C.TRITON_PREFILL, I, 64, False, narrow_tiles=2, max_registers=128),
    )
    prefill = MoEKernelConfig(
        128,
        _ws(C.TRITON_PREFILL, H, 128, True),
        _ws(dict(C.WS_TWO_GROUPS, num_stages=2, max_registers=None), I, 128, False),
    )
    triton_only = MoEKernelConfig(
        128, _ws(C.TRITON_PREFILL, H, 128, True), _ws(C.TRITON_PREFILL_GEMM2, I, 128, False), partials_in_x_dtype=True
    )
    relu2 = MoEKernelConfig(
        16, _ws(C.WS_DECODE_WIDE, H, 16, False, narrow_tiles=1), _ws(C.WS_DECODE_WIDE, I, 16, False, narrow_tiles=1)
    )
    base = dict(
        config=None,
        tokens=1,
        top_k=2,
        expert_map=False,
        variant="silu",
        rows=True,
        pdl=False,
        dtype="bfloat16",
        hidden=H,
        intermediate=I,
        row_pad=0,
    )
    rows = [
        ("pair tiles, two MMA groups (K groups), partials in x dtype", dict(config=k_groups)),
        ("pair tiles, expert map", dict(config=pairs, expert_map=True, pdl=True)),
        ("pair tiles, rows not 16-byte aligned: routed, Triton 8-token tiles", dict(config=pairs, rows=False)),
        ("8-token tiles, deep ring, GEMM2 block_n 128", dict(config=decode8, tokens=8, top_k=4, pdl=True)),
        ("8-token tiles, expert map, fp16", dict(config=decode8, tokens=8, expert_map=True, dtype="float16")),
        ("16-token tiles, narrow 1", dict(config=narrow16, tokens=16)),
        ("16-token tiles, K and N not whole chunks", dict(config=narrow16, tokens=16, **ODD)),
        ("32-token tiles, 8 MMA warps, narrow 1", dict(config=two_groups32, tokens=32, top_k=4)),
        ("64-token tiles, GEMM2 on Triton narrow 2", dict(config=mixed64, tokens=64, pdl=True)),
        ("prefill, counted routing, GEMM2 Gluon", dict(config=prefill, tokens=600, top_k=2)),
        ("prefill on Triton, partials in x dtype, expert map", dict(config=triton_only, tokens=40, expert_map=True)),
        ("prefill on Triton, K and N not whole chunks", dict(config=triton_only, tokens=40, pdl=True, **ODD)),
        ("default config, one token", dict()),
        ("default config, 64 tokens", dict(tokens=64, top_k=4)),
        ("relu2 (non-gated), Gluon", dict(config=relu2, tokens=16, variant="relu2")),
        ("relu2 (non-gated), Triton", dict(config=triton_only, tokens=16, variant="relu2")),
        ("swiglu_oai with biases, Gluon", dict(config=narrow16, tokens=16, variant="swiglu_oai")),
        ("swiglu_oai with biases, Triton", dict(config=triton_only, tokens=16, variant="swiglu_oai", pdl=True)),
        ("router weight on the input, pair tiles", dict(config=pairs, variant="router_on_input")),
        ("router weight on the input, Triton", dict(config=mixed64, tokens=8, variant="router_on_input")),
    ]
    return {name: {**base, **row} for name, row in rows}


class _Names:
    """Names of a case's tensors: a named input (or a view of it) by name, anything else by first use."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.by_storage = {t.untyped_storage().data_ptr(): name for name, t in named.items() if t is not None}
        self.buffers = 0

    def of(self, t: torch.Tensor) -> str:
        key = t.untyped_storage().data_ptr()
        if key not in self.by_storage:
            self.by_storage[key] = f"host buffer {self.buffers}"
            self.buffers += 1
        return self.by_storage[key]


def _describe(v, names: _Names):
    """A launch argument as the kernel can tell it (see the module docstring), as a short string or a list."""
    if isinstance(v, torch.Tensor):
        where = f"{names.of(v)} offset {v.storage_offset()}"
        return f"tensor {where} shape {list(v.shape)} stride {list(v.stride())} {v.dtype}"
    if isinstance(v, (TensorDescriptor, TritonTensorDescriptor)):
        layout = f" {v.layout!r}" if isinstance(v, TensorDescriptor) else ""  # Triton's picks its own
        return [
            f"descriptor shape {list(v.shape)} strides {list(v.strides)} block {v.block_shape}{layout} {v.padding}",
            _describe(v.base, names),
        ]
    if isinstance(v, tl.constexpr):
        return f"constexpr {_describe(v.value, names)}"
    if isinstance(v, tl.dtype):
        return f"dtype {v}"
    if isinstance(v, (tuple, list)):
        return [type(v).__name__, *(_describe(item, names) for item in v)]
    if v is None or isinstance(v, (bool, int, float, str)):
        return f"{type(v).__name__} {v!r}"
    raise TypeError(f"no record for a {type(v).__name__} argument: {v!r}")


class _Recorder:
    """Stands in for ``kernel[grid]``: records (kernel, grid, args, kwargs) instead of launching."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, args, kwargs))


def record(case: dict, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Run ``case``'s forward with every kernel recorded; returns the launches as described for the golden file."""
    calls = []
    for module, attr in KERNELS:
        monkeypatch.setattr(module, attr, _Recorder(attr, calls))
    monkeypatch.setattr(K, "_gluon_rows_ok", lambda x, intermediate: case["rows"])
    pdl = dict(PDL=True, launch_pdl=True) if case["pdl"] else dict(PDL=False)
    monkeypatch.setattr(triton_common, "_dependent_launch", lambda device: pdl)
    g = torch.Generator().manual_seed(0)
    variant, gated = case["variant"], case["variant"] != "relu2"
    activation = {"relu2": m.RELU2, "swiglu_oai": m.SWIGLU_OAI}.get(variant, m.SILU)
    h, i = case["hidden"], case["intermediate"]
    w13 = m.quantize_nvfp4(torch.randn(E, (2 if gated else 1) * i, h, generator=g), segments=2 if gated else 1)
    biases = (
        dict(w13_bias=torch.randn(E, 2 * i, generator=g), w2_bias=torch.randn(E, h, generator=g))
        if variant == "swiglu_oai"
        else {}
    )
    w = m.prepare_moe_weights(w13, m.quantize_nvfp4(torch.randn(E, h, i, generator=g)), activation=activation, **biases)
    t, top_k = case["tokens"], case["top_k"]
    x = torch.randn(t, h + case["row_pad"], generator=g).to(getattr(torch, case["dtype"]))[:, :h]
    expert_map = torch.tensor([-1] + list(range(E)) + [-1], dtype=torch.int32) if case["expert_map"] else None
    tw, ti = m.topk_softmax(torch.randn(t, E if expert_map is None else E + 2, generator=g), top_k)
    out = torch.empty_like(x)
    config = case["config"]
    named = dict(
        x=x,
        w13_packed=w.w13_packed,
        w13_scale=w.w13_scale,
        w13_global=w.w13_global,
        w2_packed=w.w2_packed,
        w2_scale=w.w2_scale,
        w2_global=w.w2_global,
        topk_weights=tw,
        topk_ids=ti,
        expert_map=expert_map,
        w13_bias=w.w13_bias,
        w2_bias=w.w2_bias,
        out=out,
    )
    K.fused_moe_sm90(x, w, tw, ti, expert_map, config, out, apply_router_weight_on_input=variant == "router_on_input")
    names = _Names(named)
    return [
        dict(
            kernel=name,
            grid=_describe(grid, names),
            args=[_describe(a, names) for a in args],
            kwargs={key: _describe(v, names) for key, v in sorted(kwargs.items())},
        )
        for name, grid, args, kwargs in calls
    ]


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_launches_match_the_golden_record(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of the forward, in order, argument for argument as the golden file (the code before the launch
    groups) has it: a reordered, added, dropped or changed argument fails here, naming the kernel and the argument."""
    want = json.loads(GOLDEN.read_text())[name]
    got = record(CASES[name], monkeypatch)
    assert [c["kernel"] for c in got] == [c["kernel"] for c in want]
    for n, (g, w) in enumerate(zip(got, want)):
        where = f"launch {n} ({g['kernel']})"
        assert g["grid"] == w["grid"], where
        assert len(g["args"]) == len(w["args"]), f"{where}: {len(g['args'])} positional arguments, not {len(w['args'])}"
        for i, (a, b) in enumerate(zip(g["args"], w["args"])):
            assert a == b, f"{where}: positional argument {i}"
        assert g["kwargs"] == w["kwargs"], where


def test_cases_cover_every_kernel_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden cases launch both GEMM kernels as GEMM1 and GEMM2, pair tiles with and without a map, both routing
    paths and the combine; so the comparison above cannot pass by comparing nothing."""
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(CASES)
    seen = set()
    for calls in golden.values():
        for c in calls:
            kw = c["kwargs"]
            if c["kernel"] in ("_moe_gemm_kernel", "_moe_gemm_ws_kernel"):
                seen.add((c["kernel"], kw["IS_GEMM1"]))
            if c["kernel"] == "_moe_gemm_ws_kernel" and kw["PAIR_TILES"] == "bool True":
                seen.add(("pair tiles", kw["HAS_MAP"]))
            seen.add(c["kernel"])
    kinds = {(gemm, f"bool {gated}") for gemm in ("_moe_gemm_kernel", "_moe_gemm_ws_kernel") for gated in (True, False)}
    kinds |= {("pair tiles", f"bool {has_map}") for has_map in (True, False)}
    assert seen >= kinds | {"_route_kernel", "_count_kernel", "_combine_kernel"}


def _write() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        golden = {}
        for name, case in CASES.items():
            golden[name] = record(case, monkeypatch)
            monkeypatch.undo()
    # one launch a line
    lines = ",\n".join(
        f"{json.dumps(name)}: [\n" + ",\n".join(json.dumps(c) for c in calls) + "\n]" for name, calls in golden.items()
    )
    GOLDEN.write_text("{\n" + lines + "\n}\n")
    print(f"wrote {GOLDEN}: {sum(map(len, golden.values()))} launches in {len(golden)} cases")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    _write()
