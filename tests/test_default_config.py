"""The model zoo, the default config model, and how a config is chosen (measured entries, tuned files, default).

No tolerances: everything here is exact (configs, token bounds, file choice).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import moe_nvfp4.sm90.configs as sm90_configs
import moe_nvfp4.sm90.default_config as default_rule
import moe_nvfp4.sm90.tuned_configs as tuned_configs
from moe_nvfp4.expert_activation import RELU2, SILU
from moe_nvfp4.shapes import DeviceTraits, LayerShape
from moe_nvfp4.sm90.configs import CONFIG_VERSION, KERNEL_NAME, GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90.default_config import HOPPER_132, default_bounds, default_config
from moe_nvfp4.sm90.tuned_configs import configs_up_to, register_entries, select_config, tuned_file_for
from moe_nvfp4.zoo import MODELS, zoo_shape, zoo_shapes

ZOO = zoo_shapes()
H200 = DeviceTraits("NVIDIA H200", (9, 0), 132, 140)


def layer(s) -> LayerShape:
    return LayerShape(s.experts, s.top_k, s.hidden, s.intermediate, "bfloat16", s.global_experts, s.activation.gated)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch):
    """No entries measured in this process, and no tuned files (an empty config directory)."""
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    tuned_configs._tuned_entries.cache_clear()
    yield
    tuned_configs._tuned_entries.cache_clear()


# ---- the zoo ----
def test_zoo_holds_every_model_of_the_issue_with_its_per_rank_shapes() -> None:
    assert [(m.experts, m.top_k, m.hidden, m.intermediate) for m in MODELS] == [
        (8, 2, 4096, 14336),
        (8, 2, 6144, 16384),
        (128, 8, 2048, 768),
        (128, 8, 4096, 1536),
        (384, 8, 7168, 2048),
        (160, 8, 5120, 1536),
        (512, 10, 2048, 512),
        (128, 4, 2880, 2880),
        (128, 1, 5120, 8192),
        (16, 4, 6144, 10752),
        (16, 2, 4096, 6400),
        (64, 8, 2048, 1024),
        (128, 6, 2688, 1856),
    ]
    # Nemotron-3-Nano's experts are ReLU^2, not gated: its GEMM1 has I rows (a LayerShape of its own)
    assert [m.key for m in MODELS if m.activation is not SILU] == ["nemotron-3-nano"]
    assert zoo_shape("nemotron-3-nano").activation is RELU2 and not layer(zoo_shape("nemotron-3-nano")).gated
    keys = [s.key for s in ZOO]
    assert len(keys) == len(set(keys))
    for m in MODELS:
        mine = [s for s in ZOO if s.key.startswith(m.key) and s.global_experts == m.experts]
        assert mine[0].key == m.key and (mine[0].tp, mine[0].ep) == (1, 1)
        assert len(mine) == (1 + 5 - (m.key == "gpt-oss-120b") if m.large else 1)  # gpt-oss: 2880 / 8 splits a block
    kimi = zoo_shape("kimi-k2-ep8")
    assert (kimi.experts, kimi.global_experts, kimi.intermediate) == (48, 384, 2048)
    assert (zoo_shape("qwen3-235b-a22b-tp8").intermediate, zoo_shape("qwen3-235b-a22b-tp8").experts) == (192, 128)
    with pytest.raises(ValueError, match="gpt-oss-120b-tp8"):
        zoo_shape("gpt-oss-120b-tp8")
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo_shapes("llama-2")


# ---- rows per busy expert ----
@pytest.mark.parametrize("shape", ZOO, ids=[s.key for s in ZOO])
def test_rows_per_busy_expert_start_at_one_and_rise_to_the_mean(shape) -> None:
    s = layer(shape)
    rows = [s.rows_per_active_expert(t) for t in range(1, 4097)]
    assert rows[0] == pytest.approx(1.0)
    assert all(a <= b + 1e-9 for a, b in zip(rows, rows[1:]))
    mean = 65536 * shape.top_k / shape.global_experts
    assert s.rows_per_active_expert(65536) == pytest.approx(mean, rel=1e-6)  # every expert busy
    for bound in (1.5, 5, 20, 64):
        t = s.tokens_up_to_rows(bound)
        assert s.rows_per_active_expert(t) <= bound < s.rows_per_active_expert(t + 1)


def test_rows_per_busy_expert_do_not_depend_on_the_local_share() -> None:
    full, ep8 = LayerShape(384, 8, 7168, 2048), LayerShape(48, 8, 7168, 2048, global_experts=384)
    assert all(full.rows_per_active_expert(t) == ep8.rows_per_active_expert(t) for t in (1, 7, 64, 1000))
    assert LayerShape(8, 8, 256, 256).rows_per_active_expert(5) == 5  # top-k = E: every token on every expert


def test_local_pairs_are_the_ranks_share_of_the_routed_pairs() -> None:
    """What the W4A8 bound, the pair-tile presets and the bench's FLOPs count: T k E / E_g, not floored."""
    assert LayerShape(384, 8, 7168, 2048).local_pairs(3) == 24
    assert LayerShape(2, 4, 6144, 10752, global_experts=16).local_pairs(1) == 0.5  # DBRX EP8, one token
    assert LayerShape(48, 8, 7168, 2048, global_experts=384).local_pairs(4096) == 4096


# ---- the default ----
@pytest.mark.parametrize("shape", ZOO, ids=[s.key for s in ZOO])
def test_default_is_valid_on_every_zoo_shape(shape) -> None:
    s = layer(shape)
    for t in (0, 1, 2, 3, 4, 16, 50, 64, 200, 256, 1000, 1024, 4096, 20000):
        cfg = default_config(t, s.experts, s.top_k, s.hidden, s.intermediate, global_experts=s.global_experts)
        assert s.accepts(cfg), (t, cfg)


@pytest.mark.parametrize(
    "e,k,h,i",
    [
        (1, 1, 16, 16),
        (7, 3, 48, 80),
        (1024, 16, 7168, 2048),
        (60, 4, 1008, 1360),
        (256, 8, 7168, 256),
        (32, 4, 16, 65536 - 16),
    ],
)
def test_default_is_valid_on_odd_shapes(e: int, k: int, h: int, i: int) -> None:
    for t in (1, 2, 3, 5, 9, 33, 129, 1025, 5000):
        cfg = default_config(t, e, k, h, i)
        assert LayerShape(e, k, h, i).accepts(cfg), (t, cfg)


@pytest.mark.parametrize(
    "s",
    [
        layer(zoo_shape(key))
        for key in (
            "mixtral-8x7b",
            "qwen3-30b-a3b",
            "kimi-k2-ep8",
            "llama-4-maverick",
            "dbrx-tp8",
            "qwen3-next-80b-a3b",
        )
    ]
    + [LayerShape(60, 4, 256, 256), LayerShape(512, 16, 256, 256), LayerShape(3, 3, 64, 64)],
    ids=str,
)
def test_configs_up_to_finds_every_default_config(fresh_process, s: LayerShape, monkeypatch, tmp_path) -> None:
    """Every config the default gives for 1..8192 tokens, found from its bounds alone (what a warm-up compiles)."""
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)
    seen: dict[MoEKernelConfig, int] = {}
    for t in range(1, 8193):
        seen.setdefault(select_config(t, s, H200), t)
    assert configs_up_to(8192, s, H200) == seen
    assert default_bounds(s, H200) == sorted(default_bounds(s, H200))


def test_default_follows_the_kernel_families_the_tuned_entries_chose() -> None:
    """One or two tokens: pair tiles; decode: 8-token tiles, both GEMMs warp-specialized; 128-token prefill tiles on
    the Triton kernel, GEMM2 warp-specialized where its K is long; K groups where a GEMM's tiles cannot fill the
    SMs (Llama-4-Maverick's one expert at one token); the partials in x's dtype past top-2."""
    mixtral, qwen3, maverick = (layer(zoo_shape(k)) for k in ("mixtral-8x7b", "qwen3-30b-a3b", "llama-4-maverick"))

    def cfg(s: LayerShape, t: int, device: DeviceTraits = HOPPER_132) -> MoEKernelConfig:
        return default_config(t, s.experts, s.top_k, s.hidden, s.intermediate, device=device)

    for s in (mixtral, qwen3, maverick):
        one = cfg(s, 1)
        assert one.pair_tiles and one.block_m == 8 and one.gemm1.warp_specialized and one.gemm2.warp_specialized
        assert not cfg(s, 3).pair_tiles
    assert cfg(maverick, 1).gemm1.k_groups == cfg(maverick, 1).gemm2.k_groups == 2  # 128 and 80 tiles of 64 rows
    assert cfg(qwen3, 1).gemm1.k_groups == 2 and cfg(qwen3, 1).gemm2.k_groups == 1  # 96 and 256 tiles
    assert cfg(qwen3, 1, DeviceTraits("x", (9, 0), 78)).gemm2.k_groups == 1  # fewer SMs: 256 tiles fill them
    assert cfg(qwen3, 1, DeviceTraits("x", (9, 0), 300)).gemm2.k_groups == 2
    for s, t in ((mixtral, 16), (qwen3, 64)):
        decode = cfg(s, t)
        assert decode.block_m == 8 and decode.gemm1.warp_specialized and decode.gemm2.warp_specialized
        assert (decode.gemm1.block_n, decode.gemm2.block_n) == (64, default_rule.DECODE_GEMM2_BLOCK_N)  # N = I, N = H
    for s in (mixtral, qwen3):
        prefill = cfg(s, 4096)
        assert prefill.block_m == 128 and not prefill.gemm1.warp_specialized and prefill.partials_in_x_dtype
        assert prefill.gemm2 == default_rule.fit_gemm(default_rule.TRITON_PREFILL_GEMM2, s.padded_k[1], 128, False)
    assert cfg(qwen3, 16).partials_in_x_dtype and not cfg(mixtral, 16).partials_in_x_dtype


def test_decode_tiles_that_cannot_fill_the_sms_take_the_deep_ring() -> None:
    """8-token tiles: a GEMM whose expected 64-row tiles (busy experts x token tiles x N / 64) are fewer than the
    SMs runs one program per SM with a deeper ring; where they fill the SMs, two programs with the plain one.
    GEMM2's 128-row tiles do not change that count (DECODE_GEMM2_BLOCK_N)."""
    glm_tp8, mixtral_ep8 = layer(zoo_shape("glm-4.5-tp8")), layer(zoo_shape("mixtral-8x22b-ep8"))
    assert (
        glm_tp8.decode_tiles(4, glm_tp8.intermediate, 8, 64)
        < 132
        <= glm_tp8.decode_tiles(16, glm_tp8.intermediate, 8, 64)
    )

    def gemms(s: LayerShape, t: int, sm: int = 132) -> tuple[GemmConfig, GemmConfig]:
        cfg = default_config(
            t,
            s.experts,
            s.top_k,
            s.hidden,
            s.intermediate,
            global_experts=s.global_experts,
            device=DeviceTraits("x", (9, 0), sm),
        )
        assert cfg.block_m == 8
        return cfg.gemm1, cfg.gemm2

    def deep(g: GemmConfig) -> bool:
        return g.programs_per_sm == 1 and g.num_stages * g.chunks_per_stage == 6

    g1, g2 = gemms(glm_tp8, 4)  # ~30 busy experts x 3 tiles of I = 192; x 80 tiles of H
    assert deep(g1) and not deep(g2) and g2.programs_per_sm == 2
    assert not any(deep(g) for g in gemms(glm_tp8, 16))
    assert not deep(gemms(glm_tp8, 4, sm=78)[0]) and deep(
        gemms(glm_tp8, 4, sm=100)[0]
    )  # 89 tiles: the SM count decides
    g1, g2 = gemms(mixtral_ep8, 16)  # one local expert of 8: 256 tiles of I, 96 of H
    assert not deep(g1) and deep(g2)


def test_one_group_gemms_whose_128_row_tiles_cannot_fill_the_sms_take_64_rows() -> None:
    """default_config._fill_the_sms: a 4-warp GEMM whose expected 128-row tiles are fewer than the SMs takes 64-row tiles;
    one whose tiles fill them, and the 8-warp presets, keep 128 (design 004 decision 11)."""
    mixtral_ep8, dbrx_ep8, mixtral = (layer(zoo_shape(k)) for k in ("mixtral-8x22b-ep8", "dbrx-ep8", "mixtral-8x7b"))

    def cfg(s: LayerShape, t: int, sm: int = 132) -> MoEKernelConfig:
        device = DeviceTraits("x", (9, 0), sm)
        return default_config(
            t, s.experts, s.top_k, s.hidden, s.intermediate, global_experts=s.global_experts, device=device
        )

    # one local expert of 8 at T=32: 16-token tiles, 128 tiles of I and 48 of H at 128 rows
    assert mixtral_ep8.decode_tiles(32, mixtral_ep8.intermediate, 16, 128) < 132
    c = cfg(mixtral_ep8, 32)
    assert c.block_m == 16 and (c.gemm1.block_n, c.gemm2.block_n) == (64, 64)
    assert (cfg(mixtral_ep8, 32, sm=100).gemm1.block_n, cfg(mixtral_ep8, 32, sm=100).gemm2.block_n) == (128, 64)
    c = cfg(dbrx_ep8, 8)  # 8-token tiles: GEMM2 (DECODE_GEMM2_BLOCK_N) at 64 rows; GEMM1's decode preset is 64
    assert c.block_m == 8 and (c.gemm1.block_n, c.gemm2.block_n) == (64, 64)
    c = cfg(dbrx_ep8, 128)  # 64-token tiles: two MMA warp groups, 128 rows whatever the tile count
    assert c.block_m == 64 and c.gemm2.num_warps == 8 and c.gemm2.block_n == 128
    assert cfg(mixtral, 16).gemm2.block_n == default_rule.DECODE_GEMM2_BLOCK_N  # 8 experts x 32 tiles of H: filled


def test_rings_shrink_to_whole_chunks_and_shared_memory() -> None:
    """A GEMM whose K chunks do not divide by the preset's chunks per stage keeps the ring's depth in single chunks."""
    cfg = default_config(16, 8, 2, 16 * 8 * 3, 1408)  # K = 384 (3 chunks) and 1408 (11 chunks)
    # GEMM1's 8 x 22 tiles fill 132 SMs (the plain preset), GEMM2's 8 x 6 do not (the deep one)
    for g, preset in ((cfg.gemm1, default_rule.WS_DECODE), (cfg.gemm2, default_rule.WS_DECODE_DEEP)):
        assert g.chunks_per_stage == 1 and g.num_stages == preset["num_stages"] * preset["chunks_per_stage"]
        assert g.ws_shared_bytes(g is cfg.gemm1, cfg.block_m) <= sm90_configs.WS_SMEM_LIMIT


# ---- choosing ----
def _write_file(directory: Path, device: str, meta_extra: dict, entries: list[dict]) -> Path:
    meta = dict(kernel=KERNEL_NAME, version=CONFIG_VERSION, device=device, **meta_extra)
    path = tuned_configs.config_path(device, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, entries=entries)))
    return path


def _entry(cfg: MoEKernelConfig, max_tokens: int, **shape) -> dict:
    fields = dict(experts=8, top_k=2, hidden=256, intermediate=256, dtype="bfloat16") | shape
    return dict(fields, max_tokens=max_tokens, config=cfg.to_dict())


SMALL = MoEKernelConfig(16, GemmConfig(64), GemmConfig(64, num_stages=3))
LARGE = MoEKernelConfig(128, GemmConfig(128, num_warps=8), GemmConfig(128, num_warps=8))


def test_files_serve_their_device_then_parts_of_the_same_capability_and_sm_count(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)
    h100 = _write_file(tmp_path, "NVIDIA H100 80GB HBM3", dict(capability=[9, 0], sm_count=132, memory_gib=80), [])
    h200 = _write_file(tmp_path, "NVIDIA H200", dict(capability=[9, 0], sm_count=132, memory_gib=140), [])
    _write_file(tmp_path, "Old GPU", {}, [])  # no traits in its meta: serves only its own name
    assert tuned_file_for(H200) == h200
    assert tuned_file_for(DeviceTraits("NVIDIA GH200 144G HBM3e", (9, 0), 132, 143)) == h200
    assert tuned_file_for(DeviceTraits("NVIDIA H100 NVL", (9, 0), 132, 94)) == h100
    assert tuned_file_for(DeviceTraits("NVIDIA H100 PCIe", (9, 0), 114, 80)) is None  # other SM count
    assert tuned_file_for(DeviceTraits("NVIDIA H20", (9, 0), 78, 96)) is None
    assert tuned_file_for(DeviceTraits("Old GPU", (8, 0), 108, 40)).name == "Old_GPU.json"


def test_shipped_files_record_the_traits_they_serve() -> None:
    for path in sorted((tuned_configs.CONFIG_DIR / KERNEL_NAME).glob("*.json")):
        meta, entries = tuned_configs.load_config_file(str(path))
        assert meta["capability"] == [9, 0] and meta["sm_count"] == 132 and meta["memory_gib"] in (80, 140)
        assert {(e["experts"], e["top_k"]) for e in entries} == {(8, 2), (128, 8)}


def test_measured_entries_come_before_the_file_and_the_file_before_the_default(
    fresh_process, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)
    _write_file(
        tmp_path,
        "NVIDIA H200",
        dict(capability=[9, 0], sm_count=132, memory_gib=140),
        [_entry(SMALL, 16), _entry(LARGE, 4096)],
    )
    s = LayerShape(8, 2, 256, 256)
    assert select_config(1, s, H200) == SMALL and select_config(17, s, H200) == LARGE
    assert select_config(4096, s, H200) == LARGE
    assert select_config(4097, s, H200) == default_config(4097, 8, 2, 256, 256)  # past every entry: the default
    for other in (
        LayerShape(8, 1, 256, 256),
        LayerShape(8, 2, 256, 256, "float16"),
        LayerShape(8, 2, 256, 256, global_experts=16),
    ):  # top-k, dtype, expert parallelism differ
        assert select_config(1, other, H200) == default_config(
            1, other.experts, other.top_k, 256, 256, global_experts=other.global_experts
        )
    register_entries(H200, [_entry(LARGE, 8)])
    assert select_config(1, s, H200) == LARGE and tuned_configs.entries_for(s, H200)[0]["max_tokens"] == 8
    register_entries(H200, [_entry(SMALL, 8)])  # the same bucket again replaces it
    assert select_config(1, s, H200) == SMALL and len(tuned_configs.measured_entries(s, H200)) == 1
    # measured entries only, the file not consulted; past them the default's configs
    assert configs_up_to(8, s, H200) == {SMALL: 1}
    assert list(configs_up_to(4096, s, H200).items())[:2] == [(SMALL, 1), (default_config(9, 8, 2, 256, 256), 9)]
    bad = _entry(dataclasses.replace(SMALL, block_m=8), 16)  # 8-token tiles need both GEMMs warp-specialized
    with pytest.raises(ValueError, match="invalid config"):
        register_entries(H200, [bad])


def test_a_file_entry_without_top_k_is_refused(tmp_path) -> None:
    entry = _entry(SMALL, 16)
    del entry["top_k"]
    path = _write_file(tmp_path, "Fake", {}, [entry])
    with pytest.raises(ValueError, match="top_k"):
        tuned_configs.load_config_file(str(path))


def test_layer_shape_normalizes_dtype_and_global_experts() -> None:
    s = LayerShape(8, 2, 256, 256, torch.float16)
    assert s.dtype == "float16" and s.global_experts == 8
    assert s.entry_key == (8, 8, 2, 256, 256, "float16", True)  # gated: GEMM1 has gate and up rows
    assert math.isclose(LayerShape(128, 8, 256, 256).rows_per_active_expert(16), 128 / (128 * (1 - (15 / 16) ** 16)))


def test_expert_parallel_shapes_size_the_pair_presets_by_their_local_pairs(fresh_process) -> None:
    """Under expert parallelism the default at T <= 2 runs the pair presets on routed 8-row tiles (pair tiles through
    the map measured slower, design 004 decision 7; the kernel still takes them with a map when a config asks:
    test_sm90_ptx.test_pair_tiles_launch_no_routing_kernel), sized by the pairs the rank expects, T k E/E_g
    (decision 9): the whole layer's presets at that many pairs."""
    ep = [layer(s) for s in ZOO if s.global_experts != s.experts]
    assert ep
    for s in ep:
        for t in (1, 2):
            local = select_config(t, s, H200)
            assert not local.pair_tiles and local.block_m == 8, (s, t)
            assert select_config(t, dataclasses.replace(s, global_experts=0), H200).pair_tiles  # no map: pair tiles
            assert local.gemm1.warp_specialized and local.gemm2.warp_specialized
            pairs = t * s.top_k * s.experts / s.global_experts
            for g, n in ((local.gemm1, s.intermediate), (local.gemm2, s.hidden)):
                units = pairs * -(-n // 64)
                assert (g.k_groups == 2) == (units < 132), (s, t, units, g)
                assert (g.block_n == 128) == (units >= 2 * 132), (s, t, units, g)
        assert not select_config(3, s, H200).pair_tiles
    # DBRX EP8 at one token expects half a pair: K groups, where the whole layer's four pairs take 128-row tiles
    assert select_config(1, layer(zoo_shape("dbrx-ep8")), H200).gemm1.k_groups == 2
    assert select_config(1, layer(zoo_shape("dbrx")), H200).gemm1.block_n == 128
    # Qwen3-235B EP2 expects 4 pairs, 256 tiles of H: 64-row tiles, where the whole layer's 8 take 128-row ones
    assert select_config(1, layer(zoo_shape("qwen3-235b-a22b-ep2")), H200).gemm2.block_n == 64
    assert select_config(1, layer(zoo_shape("qwen3-235b-a22b")), H200).gemm2.block_n == 128
