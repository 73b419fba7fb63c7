"""The fp32 precision switch (exact fp32 or TF32) and what it changes: which problems may run in TF32,
which algorithms support them, the tuner's key, agreement bound and choices version (CPU; the
kernels themselves are in test_tf32_gpu.py)."""

import numpy as np
import pytest

from cupysparse import settings
from cupysparse.tuning import measurement as measuring
from cupysparse.cuda import precision
from cupysparse.tuning import search_space, tuner
from cupysparse.tuning.search_space import AlgorithmFilter
from cupysparse.algorithms import CONV, ConvProblem, get_algorithm
from cupysparse.algorithms.tensor_core import mma
from cupysparse.cuda.dtypes import FLOAT16, FLOAT32, FLOAT64

# The smallest opt-in shared memory per block of an sm_8x GPU (sm_86 / sm_89), in bytes.
SMALLEST_SM80_SHARED_BYTES = 99 * 1024


@pytest.fixture(autouse=True)
def default_precision(monkeypatch):
    monkeypatch.delenv(settings.FP32_PRECISION.name, raising=False)
    precision.set_fp32_precision(None)
    yield
    precision.set_fp32_precision(None)


def gpu_problem(dtype=FLOAT32, capability=90, tf32=False):
    return ConvProblem(10**5, 10**5, 64, 64, 27, dtype, "cuda", capability, tf32=tf32)


def test_exact_fp32_is_the_default_and_each_way_of_choosing_works(monkeypatch):
    assert precision.get_fp32_precision() == "ieee"
    monkeypatch.setenv(settings.FP32_PRECISION.name, " TF32 ")
    assert precision.get_fp32_precision() == "tf32"
    precision.set_fp32_precision("ieee")  # a call overrides the environment
    assert precision.get_fp32_precision() == "ieee"
    with precision.fp32_precision("tf32"):
        assert precision.get_fp32_precision() == "tf32"
    assert precision.get_fp32_precision() == "ieee"
    precision.set_fp32_precision(None)
    assert precision.get_fp32_precision() == "tf32"


def test_a_misspelt_precision_is_refused_with_the_valid_names(monkeypatch):
    with pytest.raises(ValueError, match="ieee, tf32"):
        precision.set_fp32_precision("tf16")
    monkeypatch.setenv(settings.FP32_PRECISION.name, "fast")
    with pytest.raises(ValueError, match="CUPYSPARSE_FP32_PRECISION"):
        precision.get_fp32_precision()


def test_the_context_manager_restores_the_previous_choice_after_an_error():
    precision.set_fp32_precision("tf32")
    with pytest.raises(RuntimeError), precision.fp32_precision("ieee"):
        raise RuntimeError
    assert precision.get_fp32_precision() == "tf32"


def test_only_fp32_on_a_gpu_runs_in_tf32():
    assert not precision.uses_tf32(FLOAT32, on_gpu=True)
    with precision.fp32_precision("tf32"):
        assert precision.uses_tf32(FLOAT32, on_gpu=True)
        assert not precision.uses_tf32(FLOAT32, on_gpu=False)
        assert not precision.uses_tf32(FLOAT16, on_gpu=True)
        assert not precision.uses_tf32(FLOAT64, on_gpu=True)


def test_a_cpu_problem_is_never_tf32():
    from cupysparse.geometry.kernel_map import KernelMap

    kernel_map = KernelMap(np.array([[0, 1], [1, -1]], np.int32), 2, (2,), (1,), (1,), False, False)
    with precision.fp32_precision("tf32"):
        problem = ConvProblem.of(np.zeros((2, 4), np.float32), kernel_map, 8)
    assert not problem.tf32


def test_mma_runs_fp32_only_as_tf32_and_only_from_sm80():
    algorithm = get_algorithm("mma_implicit_gemm")
    reason = algorithm.unsupported_reason(gpu_problem())
    assert "TF32" in reason and "set_fp32_precision('tf32')" in reason
    assert algorithm.supports(gpu_problem(tf32=True))
    assert "8.0" in algorithm.unsupported_reason(gpu_problem(capability=75, tf32=True))
    assert not get_algorithm("wmma_implicit_gemm").supports(gpu_problem(tf32=True))
    assert not algorithm.supports(gpu_problem(FLOAT64, tf32=False))


@pytest.mark.parametrize(("capability", "tensor_core_algorithms"), [
    (80, {"mma_implicit_gemm"}),
    (90, {"mma_implicit_gemm", "wgmma_implicit_gemm"}),
])
def test_under_tf32_auto_measures_the_tensor_core_kernels_only(capability, tensor_core_algorithms, monkeypatch):
    from cupysparse.algorithms.tensor_core import wgmma as wgmma_implicit_gemm

    monkeypatch.setattr(wgmma_implicit_gemm, "nvrtc_knows", lambda architecture: True)
    pool = search_space.candidates(AlgorithmFilter(CONV, "forward", "auto", ()), gpu_problem(capability=capability,
                                                                                       tf32=True))
    assert {algorithm.name for algorithm, _ in pool} == tensor_core_algorithms
    exact = search_space.candidates(AlgorithmFilter(CONV, "forward", "auto", ()), gpu_problem(capability=capability))
    assert not tensor_core_algorithms & {algorithm.name for algorithm, _ in exact}


def test_tf32_measurements_have_their_own_key():
    exact, tf32 = tuner.tuning_key(gpu_problem()), tuner.tuning_key(gpu_problem(tf32=True))
    assert exact != tf32
    assert dict(tf32)["fp32_precision"] == "tf32" and "fp32_precision" not in dict(exact)
    assert dict(tf32)["in_dtype"] == "float32"


def test_the_agreement_check_allows_tf32_rounding_only_for_tf32_problems():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal(256).astype(np.float32)
    tf32_like = reference * np.float32(1 + 2.0**-11)  # half a TF32 unit on every value
    assert measuring.disagreement(tf32_like, reference, np.float32, tf32=True) is None
    assert "differs" in measuring.disagreement(tf32_like, reference, np.float32)
    assert "differs" in measuring.disagreement(reference + np.float32(0.1), reference, np.float32, tf32=True)


def test_the_selection_state_moves_with_the_precision():
    """Plans kept on kernel maps select again when the precision is set in code, either way."""
    exact = settings.selection_state()
    with precision.fp32_precision("tf32"):
        in_tf32 = settings.selection_state()
        assert in_tf32 != exact
    assert settings.selection_state() not in (exact, in_tf32)


def test_the_default_tf32_configuration_fits_every_sm80_gpu():
    """`CUPYSPARSE_AUTOTUNE=0` runs the first tile and pipeline depth: they must launch on an sm_86."""
    for weight_transposed in (False, True):
        assert mma.shared_bytes(mma.TILES[0], mma.STAGES[0], weight_transposed, 4) <= SMALLEST_SM80_SHARED_BYTES
