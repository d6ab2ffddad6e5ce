"""The sm_90 MoE's kernel configurations: frozen dataclasses (``GemmConfig`` per GEMM, ``MoEKernelConfig`` per
forward) with one ``is_valid`` each, and the limits they are checked against.  Which config serves a call is
``tuned_configs.select_config``'s choice (tuned and measured entries, else ``default_config``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ..layouts import FragmentLayout

__all__ = [
    "CHUNK_K",
    "CONFIG_VERSION",
    "KERNEL_NAME",
    "TOKEN_TILES",
    "WS_SMEM_LIMIT",
    "GemmConfig",
    "MoEKernelConfig",
]

# 2: FragmentLayout kernel (block_n in 64-row units, no join_halves); 3: no tile group, K split or stream-K fields
CONFIG_VERSION = 3
KERNEL_NAME = "fused_moe_sm90"
CHUNK_K = FragmentLayout().chunk_k  # the kernel's K step (128), fixed by the weight layout
# sm_90's shared memory per block (227 KiB), less room for the warp-specialized kernel's barriers and padding
WS_SMEM_LIMIT = 227 * 1024 - 1024
SM_REGISTERS = 65536  # sm_90's registers per SM (and per block)
# Token tiles (MoEKernelConfig.block_m) the kernels run; 8 only where both GEMMs are Gluon (design 002 decision 20).
TOKEN_TILES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's launch parameters (the weight tile is BLOCK_N rows x 128 K per step).

    max_registers caps the registers per thread (ptxas ``.maxnreg``; None: the compiler's choice).  The
    decode GEMMs are issue-bound with few warps per scheduler, and registers bound how many programs fit on
    an SM: a GEMM1 tile of 128 rows takes 236 registers, two programs of 4 warps, whatever programs_per_sm
    asks for.  Capped at 168 three fit, at 128 four (ptxas then waits on each wgmma instead of spilling).

    warp_specialized: run the GEMM as the Gluon kernel (gemm_gluon): a TMA loader warp group and 4 or 8 MMA
    warps, whole K per tile.  max_registers then sets residency (uncapped one program per SM, 128 two, 80
    three: the loader's warp group counts too).  chunks_per_stage (warp-specialized only): K chunks of 128 per
    stage of its ring, fetched as one TMA box per matrix; the MMA warps keep MMAs running while they decode
    the stage's next matrix (one at 128 rows per warp group, two at 64) and retire them all at its end.

    k_groups (warp-specialized only; 1 or 2): MMA warp groups of num_warps warps that share each tile, group g
    taking its K steps g, g + k_groups, ... (each tile's steps padded to a multiple of k_groups); group 0 adds
    group 1's sums from shared memory, in the same order wherever the tile runs, so a row's bits do not
    depend on which tile it lands in.  More warps decode one tile where tiles are fewer than the SMs' program
    slots (Qwen3 GEMM1 at T=1: 96 tiles), and a program's loader warp group serves both MMA groups.
    max_registers must let one program (k_groups x num_warps MMA warps and the loader's warp group) fit an SM's
    65536 registers, and num_stages be a multiple of k_groups (each stage then always serves the same group).
    Three and four groups are gone: no tuned config chose them.

    narrow_tiles (0, 1 or 2): a tile whose rows fit in block_m / 2 (or / 4) runs its MMAs that narrow, down to 8
    tokens in the warp-specialized kernel and 16 in the Triton one (the weights are the MMA's 64-row side, the
    tokens its N).  At decode a tile then fits the largest expert, so no expert's weights stream twice, while the
    many smaller ones pay for MMAs of their own width only (design 002, decision 21).  At prefill an expert's last
    tile often holds a few rows, yet narrower MMAs there cost more in extra K loops than they save (design 002).

    loader_warps (warp-specialized only; 1, 2 or 4): the loader warp group's warps that issue the token rows'
    cp.async (one thread issues the TMA boxes).  A thread holds block_m / (2 x loader_warps) row addresses:
    one warp spills them from block_m 16 on, while at block_m 8 four warps waiting on every stage slowed
    Mixtral's long-K GEMM2 (design 002, decision 19).

    Every GEMM takes whole K per tile, its tiles in the kernels' fixed grouped order (common._grouped_tile).
    Config version 3 removed the fields of modes no tuned or default config chose: the tile group (always 8, now
    the fixed order), K splits (fp32 partials) and stream-K (equal runs of K steps per program)."""

    block_n: int = 64
    num_stages: int = 4
    num_warps: int = 4
    programs_per_sm: int = 1
    max_registers: int | None = None
    warp_specialized: bool = False
    chunks_per_stage: int = 1
    k_groups: int = 1
    narrow_tiles: int = 0
    loader_warps: int = 4

    def is_valid(self, k_padded: int) -> bool:
        chunks = k_padded // CHUNK_K
        return (
            self.block_n in (64, 128, 256)  # whole 64-row units of the layout
            and 1 <= self.num_stages <= 8
            and self.num_warps in (1, 2, 4, 8, 16)
            and (not self.warp_specialized or self._warp_specialized_ok())
            and self.chunks_per_stage in ((1, 2, 4) if self.warp_specialized else (1,))
            and (self.k_groups == 1 or (self.warp_specialized and self._k_groups_fit()))
            and self.narrow_tiles in (0, 1, 2)
            and self.loader_warps in ((1, 2, 4) if self.warp_specialized else (4,))
            and chunks % self.chunks_per_stage == 0
            and 1 <= self.programs_per_sm <= 8
            and (self.max_registers is None or (64 <= self.max_registers <= 255 and self.max_registers % 8 == 0))
        )

    @property
    def narrowest_mma(self) -> int:
        """The fewest tokens an MMA of this GEMM may be wide (wgmma's N): 8 in the Gluon kernel; Triton lowers an
        8-wide tl.dot to mma.sync, so 16 there."""
        return 8 if self.warp_specialized else 16

    def _warp_specialized_ok(self) -> bool:
        # one or two MMA warp groups of at least 64 rows each, a ring of two or more stages
        return self.num_warps in (4, 8) and self.block_n >= 16 * self.num_warps and self.num_stages >= 2

    def _k_groups_fit(self) -> bool:
        mma_warps = self.num_warps * self.k_groups
        return (
            self.k_groups == 2
            and self.num_stages % self.k_groups == 0
            and self.max_registers is not None
            and 32 * self.max_registers * (mma_warps + 4) <= SM_REGISTERS
        )

    def ws_shared_bytes(self, gated: bool, block_m: int) -> int:
        """Shared memory of the warp-specialized kernel: its ring (per stage and chunk, the token rows (16-bit)
        and each matrix's (``gated``: gate and up) 4 KiB of values and 512 bytes of scales per 64-row unit), and
        the float32 sums MMA group 1 hands to group 0 (a gate and an up tile when ``gated``)."""
        fragments = FragmentLayout()
        halves = 2 if gated else 1
        unit_bytes = fragments.block_bytes + fragments.scale_block_bytes
        per_chunk = block_m * CHUNK_K * 2 + halves * (self.block_n // fragments.unit_rows) * unit_bytes
        sums = (self.k_groups - 1) * halves * self.block_n * block_m * 4
        return self.num_stages * self.chunks_per_stage * per_chunk + sums

    def narrowed_for(self, block_m: int) -> "GemmConfig":
        """This GEMM with narrow_tiles lowered as far as ``block_m`` needs (its narrowest MMA stays narrowest_mma
        wide)."""
        narrow = self.narrow_tiles
        while narrow and block_m >> narrow < self.narrowest_mma:
            narrow -= 1
        return replace(self, narrow_tiles=narrow)

    def launch_options(self) -> dict:
        """Triton launch keywords: warps, and the register cap when there is one."""
        cap = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return {"num_warps": self.num_warps, **cap}


def _refuse_unknown_keys(d: dict, cls: type, where: str) -> None:
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}, not {cls.__name__} fields "
            f"(config version {CONFIG_VERSION})"
        )


@dataclass(frozen=True)
class MoEKernelConfig:
    """block_m (token rows per tile) is shared: both GEMMs read the same tile map.  A tile of 8 tokens (wgmma's
    narrowest N, for experts with a few tokens each) needs both GEMMs warp-specialized: Triton lowers an
    8-wide tl.dot to mma.sync, which made the Triton kernel slower, not faster (design 002).  partials_in_x_dtype:
    GEMM2 writes its rows per (token, k) in x's dtype instead of float32, halving what the combine moves
    (T * top_k * H values) for one more rounding per row, as vLLM's BF16 MoE does.  pair_tiles: every (token, k)
    pair is a token tile of its own, its expert read from topk_ids, so no routing kernel runs (one launch and its
    latency less).  A pair then streams its expert's weights alone: meant for one token, whose k pairs hit k
    distinct experts, and wasteful where pairs share experts.  It needs both GEMMs warp-specialized (the Triton
    kernel reads the routing kernel's map); where the Gluon kernel cannot run (rows not 16-byte aligned), the
    forward routes as usual.  Under an expert map the Gluon GEMMs map each pair's expert themselves and skip the
    pairs of other ranks."""

    block_m: int = 16
    gemm1: GemmConfig = field(default_factory=GemmConfig)
    gemm2: GemmConfig = field(default_factory=GemmConfig)
    partials_in_x_dtype: bool = False
    pair_tiles: bool = False

    def is_valid(self, hidden_padded: int, intermediate_padded: int, gated: bool = True) -> bool:
        """``gated``: GEMM1 streams gate and up rows (two matrices in the Gluon kernel's ring), else one."""
        return (
            (
                self.block_m in TOKEN_TILES
                and (self.block_m > 8 or (self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            )
            and all(self.block_m >> g.narrow_tiles >= g.narrowest_mma for g in (self.gemm1, self.gemm2))
            and self.gemm1.is_valid(hidden_padded)
            and self.gemm2.is_valid(intermediate_padded)
            and not (self.pair_tiles and not (self.gemm1.warp_specialized and self.gemm2.warp_specialized))
            and all(
                not g.warp_specialized or g.ws_shared_bytes(two, self.block_m) <= WS_SMEM_LIMIT
                for g, two in ((self.gemm1, gated), (self.gemm2, False))
            )
        )

    @classmethod
    def from_dict(cls, d: dict) -> "MoEKernelConfig":
        # block_m, gemm1 and gemm2 are required; fields added later are optional (older files get the defaults).
        # A key that is no field is refused, not dropped: a removed mode (version 2's K split, stream-K, tile group)
        # must not run silently as something else.
        _refuse_unknown_keys(d, cls, "config")
        for gemm in ("gemm1", "gemm2"):
            _refuse_unknown_keys(d.get(gemm, {}), GemmConfig, gemm)
        later = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("block_m", "gemm1", "gemm2")}
        return cls(block_m=d["block_m"], gemm1=GemmConfig(**d["gemm1"]), gemm2=GemmConfig(**d["gemm2"]), **later)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_token_tile(self, block_m: int) -> "MoEKernelConfig":
        """This config at token tile ``block_m``, each GEMM's narrow_tiles lowered as far as the new tile needs (its
        narrowest MMA must stay GemmConfig.narrowest_mma wide), so a move from 32-token tiles with narrow_tiles 2
        to 16 is not refused for 4-wide MMAs alone."""
        return replace(
            self, block_m=block_m, gemm1=self.gemm1.narrowed_for(block_m), gemm2=self.gemm2.narrowed_for(block_m)
        )
