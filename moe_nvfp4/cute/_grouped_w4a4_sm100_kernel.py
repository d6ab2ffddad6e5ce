"""Device code of the sm_100a W4A4 grouped GEMM (see grouped_w4a4_sm100.py for the design).

Imported only when a kernel is built: this module imports cutlass at the top.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from ._w4a4_sm100_tensors import (
    find_group,
    _SF,
    _rows,
    _scales_to_tmem,
    epilogue_view,
    load_accumulators,
    operand_layout,
    scale_layout,
    store_masked,
)
from .tiles import _OUT_DTYPES, SF_VEC, TILE_K, TILE_M

_OUT = {"Float16": cutlass.Float16, "BFloat16": cutlass.BFloat16, "Float32": cutlass.Float32}
_AB = cutlass.Float4E2M1FN
_ACC = cutlass.Float32
_EPILOGUE_WARPS = (0, 1, 2, 3)  # TMEM lanes 32w..32w+31 are readable by warp w % 4 only: warps 0-3 own rows 0-127
_MMA_WARP = 4
_TMA_WARP = 5
_TMEM_COLS = 512
_DESCRIPTOR_BYTES = 128
_DESCRIPTORS = 4  # A, B, SFA, SFB


class GroupedW4A4Sm100:
    """``__call__`` builds the TMA templates and launches; ``kernel`` is the device code; ``store_tile`` is
    the epilogue of one output tile (the MoE forms override it).  ``variant``: the
    ``grouped_w4a4_sm100.GroupedW4A4Variant`` that builds this object (not imported here: that host module
    imports this one when it builds a kernel)."""

    def __init__(self, variant):
        self.variant = variant
        self.out_dtype = _OUT[_OUT_DTYPES[variant.out_dtype]]
        self.tile_n = variant.tile_n
        self.acc_stages = variant.acc_stages
        self.threads = 32 * (len(_EPILOGUE_WARPS) + 2)
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_100")
        self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(_EPILOGUE_WARPS))
        self.tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (len(_EPILOGUE_WARPS) + 1))

    def _setup(self) -> None:
        """Tiled MMA, smem layouts and the stage count (everything static)."""
        self.tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            _AB,
            _AB,
            tcgen05.OperandMajorMode.K,
            tcgen05.OperandMajorMode.K,
            _SF,
            SF_VEC,
            tcgen05.CtaGroup.ONE,
            (TILE_M, self.tile_n),
        )
        self.mma_tiler = (TILE_M, self.tile_n, TILE_K)
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (self.tiled_mma.thr_id.shape,))

        def layouts(stages: int) -> tuple:
            return (
                sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, _AB, stages),
                sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, _AB, stages),
                blockscaled_utils.make_smem_layout_sfa(self.tiled_mma, self.mma_tiler, SF_VEC, stages),
                blockscaled_utils.make_smem_layout_sfb(self.tiled_mma, self.mma_tiler, SF_VEC, stages),
            )

        a1, b1, sfa1, sfb1 = layouts(1)
        self.stage_bytes = (
            cute.size_in_bytes(_AB, a1)
            + cute.size_in_bytes(_AB, b1)
            + cute.size_in_bytes(_SF, sfa1)
            + cute.size_in_bytes(_SF, sfb1)
        )
        reserved = 1024 + _DESCRIPTORS * _DESCRIPTOR_BYTES  # barriers, TMEM address, descriptor staging
        self.ab_stages = (self.smem_capacity - reserved) // self.stage_bytes
        self.a_layout, self.b_layout, self.sfa_layout, self.sfb_layout = layouts(self.ab_stages)
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            (TILE_M, self.tile_n, TILE_K), False, utils.LayoutEnum.ROW_MAJOR, self.out_dtype
        )

    @cute.jit
    def __call__(
        self,
        a_template: cute.Pointer,
        b_template: cute.Pointer,
        sfa_template: cute.Pointer,
        sfb_template: cute.Pointer,
        template_m: cutlass.Int32,
        template_n: cutlass.Int32,
        template_k: cutlass.Int32,
        pointers: cute.Pointer,
        sizes: cute.Pointer,
        alpha: cute.Pointer,
        descriptors: cute.Pointer,
        num_groups: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """The templates give the TMA descriptors their static part (element type, box, swizzle); every
        group's address, sizes and strides are written into per-CTA copies on the device."""
        self._setup()
        a = cute.make_tensor(a_template, operand_layout(template_m, template_k))
        b = cute.make_tensor(b_template, operand_layout(template_n, template_k))
        sfa = cute.make_tensor(sfa_template, scale_layout(a.shape))
        sfb = cute.make_tensor(sfb_template, scale_layout(b.shape))
        one_cta = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        cluster = self.cluster_layout_vmnk.shape

        def atom_a(op: object, t: cute.Tensor, layout: object, **kw: object) -> tuple:
            return cute.nvgpu.make_tiled_tma_atom_A(
                op, t, cute.slice_(layout, (None, None, None, 0)), self.mma_tiler, self.tiled_mma, cluster, **kw
            )

        def atom_b(op: object, t: cute.Tensor, layout: object, **kw: object) -> tuple:
            return cute.nvgpu.make_tiled_tma_atom_B(
                op, t, cute.slice_(layout, (None, None, None, 0)), self.mma_tiler, self.tiled_mma, cluster, **kw
            )

        tma_a, tma_tensor_a = atom_a(one_cta, a, self.a_layout)
        tma_b, tma_tensor_b = atom_b(one_cta, b, self.b_layout)
        # Scales move as 16-bit elements: the 128x4 atom rows are 16 bytes, TMA's smallest box unit is 2.
        tma_sfa, tma_tensor_sfa = atom_a(one_cta, sfa, self.sfa_layout, internal_type=cutlass.Int16)
        tma_sfb, tma_tensor_sfb = atom_b(one_cta, sfb, self.sfb_layout, internal_type=cutlass.Int16)
        self.tma_bytes = self.stage_bytes

        @cute.struct
        class SharedStorage:
            descriptors: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, _DESCRIPTORS * _DESCRIPTOR_BYTES // 8], 128
            ]
            ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.ab_stages]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.acc_stages]
            tmem_address: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(self.a_layout.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(self.b_layout.outer)], 1024]
            sSFA: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(self.sfa_layout)], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(self.sfb_layout)], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            self.tiled_mma,
            self.cluster_layout_vmnk,
            self.a_layout,
            self.b_layout,
            self.sfa_layout,
            self.sfb_layout,
            self.epi_tile,
            tma_a,
            tma_tensor_a,
            tma_b,
            tma_tensor_b,
            tma_sfa,
            tma_tensor_sfa,
            tma_sfb,
            tma_tensor_sfb,
            _rows(pointers, num_groups, self.variant.pointer_columns),
            _rows(sizes, num_groups, 3),
            _rows(alpha, num_groups, self.variant.alpha_columns),
            cute.make_tensor(
                descriptors,
                cute.make_layout(
                    (num_ctas, _DESCRIPTORS, _DESCRIPTOR_BYTES // 8),
                    stride=(_DESCRIPTORS * _DESCRIPTOR_BYTES // 8, _DESCRIPTOR_BYTES // 8, 1),
                ),
            ),
            num_groups,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], cluster=[1, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        cluster_layout_vmnk: cute.Layout,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        sfa_layout: cute.Layout,
        sfb_layout: cute.Layout,
        epi_tile: cute.Tile,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        pointers: cute.Tensor,
        sizes: cute.Tensor,
        alpha: cute.Tensor,
        descriptors: cute.Tensor,
        num_groups: cutlass.Int32,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sSFA = storage.sSFA.get_tensor(sfa_layout)
        sSFB = storage.sSFB.get_tensor(sfb_layout)

        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
        )
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(),
            num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(_EPILOGUE_WARPS)),
            cta_layout_vmnk=cluster_layout_vmnk,
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        # Global views tiled by the MMA: (MMA, MMA_M|N, MMA_K, RestM|N, RestK, RestL).
        thr_mma = tiled_mma.get_slice(0)
        tile_mk = cute.slice_(self.mma_tiler, (None, 0, None))
        tile_nk = cute.slice_(self.mma_tiler, (0, None, None))
        tCgA = thr_mma.partition_A(cute.local_tile(mA, tile_mk, (None, None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, tile_nk, (None, None, None)))
        tCgSFA = thr_mma.partition_A(cute.local_tile(mSFA, tile_mk, (None, None, None)))
        tCgSFB = thr_mma.partition_B(cute.local_tile(mSFB, tile_nk, (None, None, None)))

        single = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, single, cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, single, cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(
            tma_sfa, 0, single, cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3)
        )
        tBsSFB, tBgSFB = cpasync.tma_partition(
            tma_sfb, 0, single, cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3)
        )
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages)).layout

        descriptor_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, _DESCRIPTOR_BYTES)
        desc_smem = storage.descriptors.data_ptr()
        words = _DESCRIPTOR_BYTES // 8
        desc_smem_ptrs = tuple(desc_smem + i * words for i in range(_DESCRIPTORS))
        desc_gmem_ptrs = tuple(
            descriptor_manager.get_tensormap_ptr(descriptors[(cta, i, None)].iterator) for i in range(_DESCRIPTORS)
        )
        atoms = (tma_a, tma_b, tma_sfa, tma_sfb)

        if warp == _TMA_WARP:
            for atom, ptr in zip(atoms, desc_smem_ptrs):
                descriptor_manager.init_tensormap_from_atom(atom, ptr, _TMA_WARP)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            group, first = find_group(self.tile_n, sizes, num_groups, cta, cutlass.Int32(0), cutlass.Int32(0))
            loaded_group = cutlass.Int32(-1)
            tile = cta
            while group < num_groups:
                m, n, k = sizes[group, 0], sizes[group, 1], sizes[group, 2]
                k_tiles = cute.ceil_div(k, TILE_K)
                if k_tiles > 0:
                    if group != loaded_group:
                        self.point_descriptors_at(
                            descriptor_manager, atoms, desc_gmem_ptrs, desc_smem_ptrs, pointers, group, m, n, k
                        )
                        for ptr in desc_gmem_ptrs:
                            descriptor_manager.fence_tensormap_update(ptr)
                        loaded_group = group
                    tiles_n = cute.ceil_div(n, self.tile_n)
                    tile_m = (tile - first) // tiles_n
                    tile_n = (tile - first) % tiles_n
                    gA = tAgA[(None, tile_m, None, 0)]
                    gB = tBgB[(None, tile_n, None, 0)]
                    gSFA = tAgSFA[(None, tile_m, None, 0)]
                    gSFB = tBgSFB[(None, tile_n, None, 0)]
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipeline.producer_acquire(state)
                        barrier = ab_pipeline.producer_get_barrier(state)
                        for atom, src, dst, ptr in (
                            (tma_a, gA, tAsA, desc_gmem_ptrs[0]),
                            (tma_b, gB, tBsB, desc_gmem_ptrs[1]),
                            (tma_sfa, gSFA, tAsSFA, desc_gmem_ptrs[2]),
                            (tma_sfb, gSFB, tBsSFB, desc_gmem_ptrs[3]),
                        ):
                            cute.copy(
                                atom,
                                src[(None, kt)],
                                dst[(None, state.index)],
                                tma_bar_ptr=barrier,
                                tma_desc_ptr=descriptor_manager.get_tensormap_ptr(ptr, cute.AddressSpace.generic),
                            )
                        state.advance()
                tile = tile + num_ctas
                group, first = find_group(self.tile_n, sizes, num_groups, tile, group, first)
            ab_pipeline.producer_tail(state)

        if warp == _MMA_WARP:
            self.tmem_alloc_barrier.arrive_and_wait()
            acc_ptr = cute.arch.retrieve_tmem_ptr(
                _ACC, alignment=16, ptr_to_buffer_holding_addr=storage.tmem_address.ptr
            )
            tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_layout)
            # Scales live in TMEM right after the accumulators: SFA, then SFB.
            sfa_ptr = cute.recast_ptr(acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc), dtype=_SF)
            tCtSFA = cute.make_tensor(
                sfa_ptr,
                blockscaled_utils.make_tmem_layout_sfa(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_layout, (None, None, None, 0))
                ),
            )
            sfb_ptr = cute.recast_ptr(
                acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc) + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
                dtype=_SF,
            )
            tCtSFB = cute.make_tensor(
                sfb_ptr,
                blockscaled_utils.make_tmem_layout_sfb(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_layout, (None, None, None, 0))
                ),
            )
            copy_sfa, sSFA_s2t, tSFA_s2t = _scales_to_tmem(sSFA, tCtSFA)
            copy_sfb, sSFB_s2t, tSFB_s2t = _scales_to_tmem(sSFB, tCtSFB)

            ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
            group, first = find_group(self.tile_n, sizes, num_groups, cta, cutlass.Int32(0), cutlass.Int32(0))
            tile = cta
            while group < num_groups:
                k_tiles = cute.ceil_div(sizes[group, 2], TILE_K)
                if k_tiles > 0:
                    acc = tCtAcc[(None, None, None, acc_state.index)]
                    acc_pipeline.producer_acquire(acc_state)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipeline.consumer_wait(ab_state)
                        stage = (None, None, None, None, ab_state.index)
                        cute.copy(copy_sfa, sSFA_s2t[stage], tSFA_s2t)
                        cute.copy(copy_sfb, sSFB_s2t[stage], tSFB_s2t)
                        for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                            tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                            tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                            cute.gemm(
                                tiled_mma,
                                acc,
                                tCrA[(None, None, kb, ab_state.index)],
                                tCrB[(None, None, kb, ab_state.index)],
                                acc,
                            )
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        ab_pipeline.consumer_release(ab_state)
                        ab_state.advance()
                    acc_pipeline.producer_commit(acc_state)
                    acc_state.advance()
                tile = tile + num_ctas
                group, first = find_group(self.tile_n, sizes, num_groups, tile, group, first)
            acc_pipeline.producer_tail(acc_state)

        if warp < _MMA_WARP:
            if warp == _EPILOGUE_WARPS[0]:
                cute.arch.alloc_tmem(_TMEM_COLS, storage.tmem_address.ptr)
            self.tmem_alloc_barrier.arrive_and_wait()
            acc_ptr = cute.arch.retrieve_tmem_ptr(
                _ACC, alignment=16, ptr_to_buffer_holding_addr=storage.tmem_address.ptr
            )
            tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_layout)
            # (EPI_M, EPI_N, subtiles M, subtiles N, STAGE): the epilogue walks the tile in epi_tile pieces.
            tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)
            t2r_atom = sm100_utils.get_tmem_load_op(
                (TILE_M, self.tile_n, TILE_K), utils.LayoutEnum.ROW_MAJOR, self.out_dtype, _ACC, epi_tile, False
            )
            tiled_t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
            thr_t2r = tiled_t2r.get_slice(tidx)
            tTR_tAcc = thr_t2r.partition_S(tAcc_epi)

            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
            group, first = find_group(self.tile_n, sizes, num_groups, cta, cutlass.Int32(0), cutlass.Int32(0))
            tile = cta
            while group < num_groups:
                m, n, k = sizes[group, 0], sizes[group, 1], sizes[group, 2]
                tiles_n = cute.ceil_div(n, self.tile_n)
                tile_m = (tile - first) // tiles_n
                tile_n = (tile - first) % tiles_n
                k_tiles = cute.ceil_div(k, TILE_K)
                if k_tiles > 0:
                    acc_pipeline.consumer_wait(acc_state)
                self.store_tile(
                    tiled_t2r,
                    thr_t2r,
                    tTR_tAcc[(None, None, None, None, None, acc_state.index)],
                    epi_tile,
                    pointers,
                    alpha,
                    group,
                    m,
                    n,
                    tile_m,
                    tile_n,
                    k_tiles,
                )
                if k_tiles > 0:
                    cute.arch.fence_view_async_tmem_load()
                    with cute.arch.elect_one():
                        acc_pipeline.consumer_release(acc_state)
                    acc_state.advance()
                tile = tile + num_ctas
                group, first = find_group(self.tile_n, sizes, num_groups, tile, group, first)

            self.epilogue_barrier.arrive_and_wait()
            if warp == _EPILOGUE_WARPS[0]:
                cute.arch.relinquish_tmem_alloc_permit()
                cute.arch.dealloc_tmem(acc_ptr, _TMEM_COLS)

    @cute.jit
    def store_tile(
        self,
        tiled_t2r: cute.TiledCopy,
        thr_t2r: cute.TiledCopy,
        tTR_tAcc: cute.Tensor,
        epi_tile: cute.Tile,
        pointers: cute.Tensor,
        alpha: cute.Tensor,
        group: cutlass.Int32,
        m: cutlass.Int32,
        n: cutlass.Int32,
        tile_m: cutlass.Int32,
        tile_n: cutlass.Int32,
        k_tiles: cutlass.Int32,
    ):
        """alpha_g * accumulator -> out_g[m, n] (row-major), rows past M_g and columns past N_g masked.
        ``tTR_tAcc``: this thread's TMEM accumulator, (copy, rest, rest, subtile M, subtile N)."""
        out_ptr = cute.make_ptr(self.out_dtype, pointers[group, 4], cute.AddressSpace.gmem, assumed_align=2)
        tile_mn, coord = (TILE_M, self.tile_n), (tile_m, tile_n)
        tTR_gC = epilogue_view(
            thr_t2r, epi_tile, cute.make_tensor(out_ptr, cute.make_layout((m, n), stride=(n, 1))), tile_mn, coord
        )
        tTR_cC = epilogue_view(thr_t2r, epi_tile, cute.make_identity_tensor((m, n)), tile_mn, coord)
        scale = alpha[group, 0]
        values = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0)].shape, _ACC)
        out = cute.make_rmem_tensor(values.shape, self.out_dtype)
        for sub_m in cutlass.range_constexpr(cute.size(tTR_gC, mode=[3])):
            for sub_n in cutlass.range_constexpr(cute.size(tTR_gC, mode=[4])):
                load_accumulators(tiled_t2r, tTR_tAcc[(None, None, None, sub_m, sub_n)], values, k_tiles)
                out.store((values.load() * scale).to(self.out_dtype))
                store_masked(
                    out, tTR_gC[(None, None, None, sub_m, sub_n)], tTR_cC[(None, None, None, sub_m, sub_n)], (m, n)
                )

    @cute.jit
    def point_descriptors_at(
        self,
        manager,
        atoms,
        gmem_ptrs,
        smem_ptrs,
        pointers: cute.Tensor,
        group: cutlass.Int32,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
    ):
        """Rewrite this CTA's four descriptors for ``group`` (address, sizes, strides), staged in smem."""

        def gmem(dtype: type, column: int, align: int) -> cute.Pointer:
            return cute.make_ptr(dtype, pointers[group, column], cute.AddressSpace.gmem, assumed_align=align)

        a = cute.make_tensor(gmem(_AB, 0, 16), operand_layout(m, k))
        b = cute.make_tensor(gmem(_AB, 1, 16), operand_layout(n, k))
        sfa = cute.make_tensor(gmem(_SF, 2, 16), scale_layout(a.shape))
        sfb = cute.make_tensor(gmem(_SF, 3, 16), scale_layout(b.shape))
        manager.update_tensormap((a, b, sfa, sfb), atoms, gmem_ptrs, _TMA_WARP, smem_ptrs)
