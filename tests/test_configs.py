"""Kernel configs: every shipped JSON file loads and validates, and each config field's validity rules.  How a
config is chosen (entries, files, the default model) is tests/test_default_config.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_nvfp4.sm90.configs import CONFIG_VERSION, GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90.tuned_configs import CONFIG_DIR, load_config_file

SHIPPED = sorted(CONFIG_DIR.glob("*/*.json"))


def test_configs_are_shipped() -> None:
    assert SHIPPED, f"no tuned config files under {CONFIG_DIR}"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_file_is_valid(path: Path) -> None:
    meta, entries = load_config_file(str(path))
    assert meta["device"].replace(" ", "_") + ".json" == path.name
    assert entries
    for entry in entries:
        cfg = MoEKernelConfig.from_dict(entry["config"])
        assert MoEKernelConfig.from_dict(cfg.to_dict()) == cfg


def test_bad_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(meta=dict(kernel="other", version=1), entries=[])))
    with pytest.raises(ValueError, match="expected meta"):
        load_config_file(str(path))
    bad_cfg = MoEKernelConfig(16, GemmConfig(64), GemmConfig(64, num_stages=9)).to_dict()  # 8 stages at most
    entry = dict(experts=8, top_k=2, hidden=256, intermediate=256, dtype="bfloat16", max_tokens=1, config=bad_cfg)
    path.write_text(json.dumps(dict(meta=dict(kernel="fused_moe_sm90", version=CONFIG_VERSION), entries=[entry])))
    with pytest.raises(ValueError, match="invalid config"):
        load_config_file(str(path))


def test_files_without_the_partials_field_still_load() -> None:
    """Entries written before partials_in_x_dtype existed load with float32 partials; new ones round-trip."""
    old = {"block_m": 32, "gemm1": {"block_n": 128}, "gemm2": {"block_n": 64, "num_stages": 3}}
    cfg = MoEKernelConfig.from_dict(old)
    assert cfg.partials_in_x_dtype is False and cfg.gemm2.num_stages == 3
    new = MoEKernelConfig(partials_in_x_dtype=True)
    assert MoEKernelConfig.from_dict(json.loads(json.dumps(new.to_dict()))) == new


def test_register_cap_is_checked_and_reaches_the_launch() -> None:
    """max_registers becomes Triton's maxnreg (ptxas .maxnreg); absent, the launch leaves it to the compiler,
    and files written before the field existed load without one."""
    assert GemmConfig(max_registers=168).is_valid(1024) and GemmConfig(max_registers=128).is_valid(1024)
    assert not any(GemmConfig(max_registers=r).is_valid(1024) for r in (0, 56, 130, 256))
    assert GemmConfig(num_warps=8, max_registers=128).launch_options() == dict(num_warps=8, maxnreg=128)
    assert GemmConfig(num_warps=4).launch_options() == dict(num_warps=4)
    capped = MoEKernelConfig(gemm1=GemmConfig(block_n=128, max_registers=168))
    assert MoEKernelConfig.from_dict(json.loads(json.dumps(capped.to_dict()))) == capped
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.max_registers is None


@pytest.mark.parametrize(
    "where,key,value",
    [
        ("gemm2", "split_k", 1),
        ("gemm1", "stream_k", False),
        ("gemm1", "group_m", 8),
        ("config", "route_in_gemm", False),
    ],
)
def test_unknown_keys_are_refused(where: str, key: str, value, tmp_path: Path) -> None:
    """from_dict refuses a key that is no field, naming it, even at what was its default: version 2's split_k,
    stream_k and group_m (their modes are removed; a file that asks for one must not run as something else)."""
    d = MoEKernelConfig(16, GemmConfig(64), GemmConfig(64)).to_dict()
    (d if where == "config" else d[where])[key] = value
    with pytest.raises(ValueError, match=rf"{where}: unknown key\(s\) '{key}'"):
        MoEKernelConfig.from_dict(d)
    entry = dict(experts=8, top_k=2, hidden=256, intermediate=256, dtype="bfloat16", max_tokens=1, config=d)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(meta=dict(kernel="fused_moe_sm90", version=CONFIG_VERSION), entries=[entry])))
    with pytest.raises(ValueError, match=key):
        load_config_file(str(path))
    assert not any(hasattr(GemmConfig(), f) for f in ("split_k", "stream_k", "group_m"))


def test_warp_specialized_takes_whole_tiles_and_pair_tiles_need_it() -> None:
    """The warp-specialized kernel reads whole K per tile and GEMM1's rows in x's dtype; its MMA warp groups are 64
    rows each.  Pair tiles (no routing kernel) need both GEMMs warp-specialized: the Triton kernel reads the
    routing kernel's tile map."""
    ws = GemmConfig(warp_specialized=True)
    assert ws.is_valid(1024)
    assert not dataclasses.replace(ws, num_warps=8).is_valid(1024)  # 64 rows over two warp groups
    assert dataclasses.replace(ws, block_n=128, num_warps=8).is_valid(1024)
    assert not dataclasses.replace(ws, num_stages=1).is_valid(1024)  # a ring needs two stages
    cfg = MoEKernelConfig(16, ws, ws)
    assert cfg.is_valid(512, 256) and MoEKernelConfig.from_dict(cfg.to_dict()) == cfg
    paired = dataclasses.replace(cfg, pair_tiles=True)  # tiles of one pair each: both GEMMs must be Gluon
    assert paired.is_valid(512, 256) and MoEKernelConfig.from_dict(paired.to_dict()) == paired
    assert not MoEKernelConfig(16, ws, GemmConfig(), pair_tiles=True).is_valid(512, 256)
    assert not MoEKernelConfig(16, GemmConfig(), ws, pair_tiles=True).is_valid(512, 256)
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).pair_tiles is False
    assert MoEKernelConfig(16, GemmConfig(), ws).is_valid(512, 256)  # either GEMM alone
    assert MoEKernelConfig(16, ws, GemmConfig()).is_valid(512, 256)
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.warp_specialized is False


def test_eight_token_tiles_need_both_gemms_warp_specialized() -> None:
    """block_m 8: the Gluon kernel runs it as wgmma m64n8k16; the Triton kernel would lower the 8-wide dot to
    mma.sync, so a config whose GEMMs are not both warp-specialized is refused."""
    ws = GemmConfig(warp_specialized=True)
    assert MoEKernelConfig(8, ws, ws).is_valid(512, 256)
    assert not MoEKernelConfig(8, ws, GemmConfig()).is_valid(512, 256)
    assert not MoEKernelConfig(8, GemmConfig(), ws).is_valid(512, 256)
    assert not MoEKernelConfig(4, ws, ws).is_valid(512, 256)


def test_warp_specialized_rings_take_whole_chunks_and_fit_shared_memory() -> None:
    """chunks_per_stage: the warp-specialized kernel's stages of several K chunks.  K must split into whole
    stages; the Triton kernel takes one chunk per stage, so other GEMMs keep 1; and the ring (token rows plus
    each matrix's values and scales, per chunk and stage) must fit in sm_90's 227 KiB, or the launch fails."""
    ring = GemmConfig(block_n=128, num_stages=2, chunks_per_stage=2, warp_specialized=True)
    assert ring.is_valid(1024) and dataclasses.replace(ring, chunks_per_stage=4).is_valid(1024)
    assert not ring.is_valid(768 - 128 * 1)  # 5 chunks
    assert not dataclasses.replace(ring, chunks_per_stage=3).is_valid(768)
    assert not dataclasses.replace(ring, warp_specialized=False).is_valid(1024)
    # GEMM1 (gate and up) at block_m 16: 2 x 2 x (16 x 128 x 2 + 2 x 2 x 4608) bytes = 82 KiB
    assert ring.ws_shared_bytes(True, 16) == 2 * 2 * (16 * 128 * 2 + 2 * 2 * 4608)
    assert ring.ws_shared_bytes(False, 16) == 2 * 2 * (16 * 128 * 2 + 2 * 4608)
    deep = dataclasses.replace(ring, num_stages=4)  # GEMM1: 176 KiB at block_m 16, 272 KiB at 64
    assert MoEKernelConfig(16, deep, deep).is_valid(1024, 1024)
    assert not MoEKernelConfig(64, deep, deep).is_valid(1024, 1024)
    assert MoEKernelConfig(64, GemmConfig(), deep).is_valid(1024, 1024)  # GEMM2: 200 KiB
    cfg = MoEKernelConfig(16, ring, ring)
    assert MoEKernelConfig.from_dict(cfg.to_dict()) == cfg
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.chunks_per_stage == 1


def test_k_groups_fit_one_program_on_an_sm() -> None:
    """k_groups: MMA warp groups sharing each tile of the warp-specialized kernel, one or two (three and four are
    removed).  One program (the groups' warps and the loader's warp group at the register cap) must fit sm_90's
    65536 registers, or the launch fails; stages are a multiple of the groups (each stage always serves one group);
    group 1's float32 sums take shared memory beside the ring."""
    groups = GemmConfig(64, num_stages=6, max_registers=168, warp_specialized=True, k_groups=2)
    assert groups.is_valid(1024)
    assert not dataclasses.replace(groups, max_registers=None).is_valid(1024)  # Triton's default: 255 x 12 warps
    assert not dataclasses.replace(groups, max_registers=176).is_valid(1024)  # 32 x 176 x 12 > 65536
    assert not dataclasses.replace(groups, num_stages=5).is_valid(1024)
    assert not dataclasses.replace(groups, warp_specialized=False).is_valid(1024)
    assert not any(
        dataclasses.replace(groups, k_groups=g, num_stages=stages, max_registers=64).is_valid(1024)
        for g, stages in ((3, 6), (4, 4), (5, 5))
    )
    assert not dataclasses.replace(groups, num_warps=8, block_n=128).is_valid(1024)  # 20 warps x 168 registers
    assert dataclasses.replace(groups, num_warps=8, block_n=128, max_registers=96).is_valid(1024)
    assert dataclasses.replace(groups, num_stages=4).is_valid(1024)
    # the ring (6 x (16 x 128 x 2 + 2 x 4608) bytes) and group 1's gate and up sums (2 x 64 x 16 x 4)
    assert groups.ws_shared_bytes(True, 16) == 6 * (16 * 128 * 2 + 2 * 4608) + 2 * 64 * 16 * 4
    assert groups.ws_shared_bytes(False, 16) == 6 * (16 * 128 * 2 + 4608) + 64 * 16 * 4
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.k_groups == 1


def test_narrow_tiles_stay_wgmma_widths() -> None:
    """narrow_tiles: a tile whose rows fit in block_m / 2 (or / 4) runs its MMAs that narrow.  The narrowest
    width must still be a wgmma N: 8 tokens or more in the Gluon kernel, 16 in the Triton one (an 8-wide tl.dot
    is an mma.sync)."""
    ws = GemmConfig(128, num_warps=8, num_stages=4, warp_specialized=True)
    for narrow, block_ms in ((1, (16, 32, 64)), (2, (32, 64, 128))):
        g = dataclasses.replace(ws, narrow_tiles=narrow)
        assert g.is_valid(1024)
        assert all(MoEKernelConfig(bm, g, ws).is_valid(1024, 1024) for bm in block_ms)
        assert all(MoEKernelConfig(bm, ws, g).is_valid(1024, 1024) for bm in block_ms)
        assert not MoEKernelConfig(block_ms[0] // 2, g, g).is_valid(1024, 1024)  # an MMA of 4 tokens
    assert not dataclasses.replace(ws, narrow_tiles=3).is_valid(1024)
    triton_gemm = GemmConfig(128, num_warps=4, num_stages=3)
    for narrow, block_ms in ((1, (32, 64, 128)), (2, (64, 128))):
        g = dataclasses.replace(triton_gemm, narrow_tiles=narrow)
        assert g.is_valid(1024)
        assert all(MoEKernelConfig(bm, g, g).is_valid(1024, 1024) for bm in block_ms)
        assert not MoEKernelConfig(block_ms[0] // 2, g, triton_gemm).is_valid(1024, 1024)  # an 8-wide tl.dot
    cfg = MoEKernelConfig(32, dataclasses.replace(ws, narrow_tiles=2), ws)
    assert MoEKernelConfig.from_dict(cfg.to_dict()) == cfg
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.narrow_tiles == 0


def test_loader_warps_only_for_the_warp_specialized_kernel() -> None:
    """loader_warps: the Gluon kernel's warps issuing the token rows (1, 2 or 4 of its loader warp group); the
    Triton kernel has no loader, so other GEMMs keep the default; files without the field load as 4."""
    ws = GemmConfig(128, num_warps=8, num_stages=4, warp_specialized=True)
    assert all(dataclasses.replace(ws, loader_warps=n).is_valid(1024) for n in (1, 2, 4))
    assert not dataclasses.replace(ws, loader_warps=3).is_valid(1024)
    assert not GemmConfig(loader_warps=1).is_valid(1024)
    cfg = MoEKernelConfig(8, dataclasses.replace(ws, loader_warps=1), ws)
    assert cfg.is_valid(1024, 1024) and MoEKernelConfig.from_dict(cfg.to_dict()) == cfg
    assert MoEKernelConfig.from_dict({"block_m": 16, "gemm1": {}, "gemm2": {}}).gemm1.loader_warps == 4
