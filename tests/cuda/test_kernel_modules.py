"""The modules each algorithm declares (`Algorithm.kernel_modules`, what the tuner compiles before
measuring) against the kernels its launch plans fetch, without a GPU: CuPy's launch machinery is
replaced by recorders."""

import itertools
import types

import numpy as np
import pytest

from cupysparse.cuda import compile as kernel_compile
from cupysparse.algorithms import ConvProblem, get_algorithm
from cupysparse.algorithms import implicit_gemm as implicit_gemm_module
from cupysparse.algorithms.tensor_core import common as common_module
from cupysparse.algorithms.tensor_core import mma as mma_module
from cupysparse.algorithms.tensor_core import wgmma as wgmma_module
from cupysparse.algorithms.tensor_core import wmma as wmma_module
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32

# Channel counts reaching every variant: rows without 16-byte copies (3, 31, 47), each block_k
# of the WMMA forward (16, 48 against 32, 64), each wgrad tile side (up to 32, 64, 128 and beyond).
CHANNELS = (3, 16, 31, 32, 47, 48, 64, 96, 128, 256)
TENSOR_CORE_DTYPES = {"wmma_implicit_gemm": (FLOAT16, BFLOAT16), "mma_implicit_gemm": (FLOAT16, BFLOAT16, FLOAT32),
                      "wgmma_implicit_gemm": (FLOAT16, BFLOAT16)}


class _RecordedLaunch:
    """Stands in for `PreparedLaunch`: records the kernel each launch runs."""

    launched: list = []

    def __init__(self, kernel, grid, block, arguments, shared_bytes=0):
        self.kernel = kernel
        self.block_threads = block[0]

    def launch(self, stream, *values, grid=None):
        _RecordedLaunch.launched.append(self.kernel)


def _pointer(address=0):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=address))


class _KernelMap:
    """What the plans read of a kernel map: sizes, a pair table, a row order, the CSR lists, and the
    values they derive from it."""

    num_in = num_out = 1000
    mirror_symmetric = True
    pair_table = _pointer()

    def __init__(self, kernel_volume):
        self.kernel_volume = kernel_volume

    def mask_sorted_order(self):
        return _pointer()

    def csr(self):
        return types.SimpleNamespace(in_idx=_pointer(), out_idx=_pointer(), offsets=_pointer())

    def wgrad_shares(self, rounds, round_major):
        return types.SimpleNamespace(table=_pointer(), slot_starts=_pointer())

    def derived(self, key, compute):
        return compute(self)


@pytest.fixture
def recorded(monkeypatch):
    """Plans built with recorded launches; `get_kernel` answers (source, name expression)."""
    for module in (common_module, wmma_module, mma_module, wgmma_module):
        monkeypatch.setattr(module, "PreparedLaunch", _RecordedLaunch)
        monkeypatch.setattr(module, "current_device", lambda: 0)
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: True)
    monkeypatch.setattr(common_module, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(common_module, "resident_threads", lambda device: 132 * 2048)
    monkeypatch.setattr(common_module, "l2_bytes", lambda device: 50 * 2**20)
    monkeypatch.setattr(kernel_compile, "get_kernel", lambda source, name: (source, name))
    monkeypatch.setattr(_RecordedLaunch, "launched", [])
    caches = (wmma_module._gemm_plan, common_module.wgrad_plan, common_module._row_padding, mma_module._plan,
              wgmma_module._plan)
    for cache in caches:
        cache.cache_clear()
    yield _RecordedLaunch.launched
    for cache in caches:  # they hold recorders, not kernels
        cache.cache_clear()


def _problem(dtype, in_channels, out_channels, kernel_volume=27):
    return ConvProblem(100_000, 100_000, in_channels, out_channels, kernel_volume, np.dtype(dtype), "cuda", 90,
                       (1, 1, 1), tf32=dtype == FLOAT32)


# (grad_input, grad_weight) addresses that ask for both gradients.
_BOTH = (1, 2)


def _launched(algorithm, phase, problem, params, operands=0):
    """(source, name expression) of every kernel one run of `phase` with `params` launches, the features
    and the gradient at address `operands` (the others at 0, all 16-byte aligned)."""
    launched = []
    kernel_map, stream = _KernelMap(problem.kernel_volume), 0
    if phase == "forward":
        plan = algorithm.forward_plan(problem, params)
        staging = {} if plan.staging_shape is None else {"staging": 0}
        plan.launch(kernel_map, operands, 0, 0, stream, **staging)
    else:
        plan = algorithm.backward_plan(problem, params)
        plan.launch(kernel_map, operands, operands, 0, _BOTH[0], 0, _BOTH[1], stream)
        plan.launch(kernel_map, operands, operands, 0, 0, 0, _BOTH[1], stream)  # the weight gradient alone: own sum
    launched.extend(_RecordedLaunch.launched)
    _RecordedLaunch.launched.clear()
    return launched


@pytest.mark.parametrize("name", sorted(TENSOR_CORE_DTYPES))
def test_the_declared_modules_are_the_ones_the_plans_launch_from_and_every_instantiation_is_launched(recorded, name):
    algorithm = get_algorithm(name)
    module = {"mma_implicit_gemm": mma_module, "wmma_implicit_gemm": wmma_module,
              "wgmma_implicit_gemm": wgmma_module}[name]
    own = {source for dtype in TENSOR_CORE_DTYPES[name] for source in module._SOURCES[dtype].sources}
    borrowed = set()
    if name == "wgmma_implicit_gemm":  # its wgrad is mma_implicit_gemm's up to 64 channels
        borrowed = {source for dtype in TENSOR_CORE_DTYPES[name] for source in mma_module._SOURCES[dtype].sources
                    if source.name_expressions[0].startswith("mma_conv_wgrad")}
    shared = {common_module.sum_source(dtype) for dtype in TENSOR_CORE_DTYPES[name]}
    # The copies of rows that are not whole 16-byte vectors (3 channels reach them in every dtype).
    shared |= {source for dtype in TENSOR_CORE_DTYPES[name] for source in common_module.padding_sources(dtype, 3)}
    reached = set()
    for dtype, in_channels, out_channels in itertools.product(TENSOR_CORE_DTYPES[name], CHANNELS, CHANNELS):
        problem = _problem(dtype, in_channels, out_channels)
        for phase in ("forward", "backward"):
            for params in algorithm.param_grid(phase):
                declared = algorithm.kernel_modules(phase, problem, params)
                launched = _launched(algorithm, phase, problem, params)
                assert {source for source, _ in launched} == set(declared), (dtype, in_channels, out_channels,
                                                                             phase, params)
                assert all(expression in source.name_expressions for source, expression in launched)
                reached.update(declared)
                # Operands not 16-byte aligned (views into a larger array) take kernels without 16-byte copies,
                # compiled when first launched.
                reached.update(source for source, _ in _launched(algorithm, phase, problem, params, operands=8))
    # Every instantiation is launched by some layer: none compiled for nothing.
    assert own | shared <= reached <= own | shared | borrowed
    assert all(len(source.name_expressions) == 1 for source in reached)  # one kernel per module


def test_the_split_families_declare_every_instantiation_once():
    for families in (wmma_module._SOURCES, mma_module._SOURCES):
        for family in families.values():
            expressions = [e for source in family.sources for e in source.name_expressions]
            assert len(expressions) == len(set(expressions)) == len(family.sources)
            assert set(family.sources) <= set(kernel_compile.registered_sources())
    fp16 = wmma_module._SOURCES[FLOAT16].name_expressions
    assert sum(e.startswith("wmma_conv_forward") and e.endswith("false>") for e in fp16) == 24
    assert sum(e.startswith("wmma_conv_forward") and e.endswith("true>") for e in fp16) == 16
    assert sum(e.startswith("wmma_conv_wgrad") for e in fp16) == 12 and len(fp16) == 24 + 16 + 12
    sums = [common_module.sum_source(dtype) for dtype in (FLOAT16, BFLOAT16, FLOAT32)]
    assert [(source.filename, source.name_expressions) for source in sums] == [
        ("wgrad_sum.cu", (f"wgrad_sum<{type_name}>",)) for type_name in ("__half", "__nv_bfloat16", "float")]
    # forward: 9 tiles x 2 stage widths (16, 32 channels) x 3 depths; dgrad: 9 x 2; wgrad: 9. TF32 has one width.
    assert len(mma_module._SOURCES[FLOAT16].sources) == 9 * 2 * 3 + 9 * 2 + 9
    assert len(mma_module._SOURCES[FLOAT32].sources) == 9 * 3 + 9 + 9


def test_declared_modules_lie_within_the_algorithms_kernel_files_and_cpu_problems_have_none():
    for name in ("implicit_gemm", "wmma_implicit_gemm", "mma_implicit_gemm", "wgmma_implicit_gemm"):
        algorithm = get_algorithm(name)
        for phase in ("forward", "backward"):
            for params in algorithm.param_grid(phase):
                modules = algorithm.kernel_modules(phase, _problem(FLOAT16, 32, 64), params)
                assert modules and {source.filename for source in modules} <= set(algorithm.kernel_sources)
                cpu = ConvProblem(10, 10, 32, 64, 27, np.dtype(FLOAT16), "cpu", None)
                assert algorithm.kernel_modules(phase, cpu, params) == ()
    simt = get_algorithm("implicit_gemm").kernel_modules("forward", _problem(BFLOAT16, 32, 32), {})
    assert simt == (implicit_gemm_module._BF16_KERNELS,)
    assert get_algorithm("explicit_gemm").kernel_modules("forward", _problem(FLOAT16, 32, 32), {}) == ()


def test_wgrad_blocks_go_round_major_where_one_block_covers_dw_and_the_operands_outgrow_twice_the_l2(recorded):
    one_tile = wgmma_module._WgmmaWgradPlan(FLOAT32, 27, 128, 128, 32)
    several_tiles = wgmma_module._WgmmaWgradPlan(FLOAT16, 27, 256, 256, 32)
    assert one_tile.grid_xy == (1, 1) and several_tiles.grid_xy == (2, 1)
    # The fixture's L2: 50 MiB. 128 fp32 channels of input and output rows take 1 KiB a voxel.
    assert one_tile.round_major(120_000, 120_000)  # 117 MiB
    assert not one_tile.round_major(80_000, 80_000)  # 78 MiB
    assert one_tile.round_major(200_000, 20_000)  # 107 MiB: the rows of both sides count
    assert not several_tiles.round_major(1_000_000, 1_000_000)
    small = mma_module.MmaWgradPlan(FLOAT16, 27, 64, 64, 32)
    assert small.grid_xy == (1, 1) and small.round_major(1_000_000, 1_000_000)


def test_the_wgrad_sum_shares_an_element_among_threads_only_where_the_gpu_has_room_for_them(recorded):
    """The fixture's GPU holds 132 x 2048 threads at once: 27 x 32 x 32 elements leave room for 9
    threads each (8 as a power of two), 27 x 64 x 64 for 3 (2), 27 x 128 x 128 for one."""
    narrow, middle, wide = (mma_module.MmaWgradPlan(FLOAT16, 27, channels, channels, 32) for channels in (32, 64, 128))
    assert [narrow.slot_groups(shares) for shares in (1, 2, 3, 5, 8, 156)] == [1, 2, 2, 4, 8, 8]
    assert [middle.slot_groups(shares) for shares in (1, 3, 40)] == [1, 2, 2]
    assert [wide.slot_groups(shares) for shares in (1, 40)] == [1, 1]


@pytest.mark.parametrize("name", sorted(TENSOR_CORE_DTYPES))
def test_a_backward_of_both_gradients_is_two_launches_the_wgrad_gemm_then_dgrad_with_the_sum(recorded, name):
    """Either gradient alone: dgrad's forward kernel, or wgrad's GEMM and its sum kernel. Both: the GEMM,
    then dgrad, whose launch sums the GEMM's partials (raw_kernels/wgrad_sum.cuh). Operands whose rows are
    not whole 16-byte vectors are copied first, the gradient for both gradients, the features for wgrad;
    with the gradient copied, dgrad's rows are wider than the weight gradient's and the sum has its own
    launch."""
    algorithm = get_algorithm(name)
    kernel_map = _KernelMap(27)
    for dtype, channels in itertools.product(TENSOR_CORE_DTYPES[name], ((32, 32), (64, 128), (256, 256), (3, 32),
                                                                        (32, 20), (3, 47))):
        plan = algorithm.backward_plan(_problem(dtype, *channels), algorithm.default_params("backward"))

        def kernels(grad_input, grad_weight):
            plan.launch(kernel_map, 0, 0, 0, grad_input, 0, grad_weight, 0)
            names = [expression.split("<")[0] for _, expression in recorded]
            recorded.clear()
            return names

        in_copied, out_copied = (channels * dtype.itemsize % 16 != 0 for channels in channels)
        gradient_copy, features_copy = ["pad_rows"] * out_copied, ["pad_rows"] * in_copied
        dgrad = kernels(_BOTH[0], 0)
        assert dgrad[:-1] == gradient_copy and dgrad[-1].endswith("_conv_forward"), (dtype, channels)
        dgrad = dgrad[-1]
        wgrad = kernels(0, _BOTH[1])
        assert wgrad[:-2] == gradient_copy + features_copy, (dtype, channels)
        gemm, wgrad_sum = wgrad[-2:]
        assert "_conv_wgrad" in gemm and wgrad_sum == "wgrad_sum"
        fused = [gemm, wgrad_sum, dgrad] if out_copied else [gemm, dgrad]
        assert kernels(*_BOTH) == gradient_copy + features_copy + fused, (dtype, channels)
