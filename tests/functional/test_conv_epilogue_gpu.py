"""The forward kernels' epilogue on the GPU (`pytest -m gpu`): `execution.fused_forward` applies
`relu?(out · scale + shift (+ residual))` in fp32 as the kernel stores its output, for every algorithm
whose plan fuses it (the tensor-core implicit GEMMs), over each kind of map, with channel counts that
store in pairs and that do not. The reference is the fp64 convolution with the epilogue applied after
it; the plain forward of the same plan must stay what it was (bitwise), and a plan without an
epilogue must decline (None), leaving the epilogue to the caller."""

import numpy as np
import pytest

from cupysparse.algorithms import CONV, get_algorithm
from cupysparse.algorithms.tensor_core.common import TensorCoreImplicitGemm
from cupysparse.cuda.backend import cupy_module
from cupysparse.functional import execution
from cupysparse.functional.epilogue import ConvEpilogue
from cupysparse.tuning.search_space import algorithm_argument
from gpu_cases import gpu_map, inputs, reference_phase, supported
from tolerances import assert_close

pytestmark = pytest.mark.gpu

# (scale and shift, residual, relu): a batch norm alone, with its ReLU, with a residual block's sum and
# ReLU, and a ReLU alone (no norm).
EPILOGUES = [(True, False, False), (True, False, True), (True, True, True), (False, False, True)]


def epilogue_inputs(num_out: int, channels: int, dtype, seed: int, with_norm: bool, with_residual: bool):
    """fp32 scale and shift away from the identity (negative scales included), a residual of `dtype`."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(-1.5, 1.5, channels).astype(np.float32) if with_norm else None
    shift = rng.uniform(-0.5, 0.5, channels).astype(np.float32) if with_norm else None
    residual = rng.standard_normal((num_out, channels)).astype(dtype) if with_residual else None
    return scale, shift, residual


def reference(conv64, scale, shift, residual, relu: bool) -> np.ndarray:
    out = conv64.copy()
    if scale is not None:
        out = out * scale.astype(np.float64) + shift.astype(np.float64)
    if residual is not None:
        out = out + residual.astype(np.float64)
    return np.maximum(out, 0) if relu else out


@pytest.mark.parametrize("with_norm, with_residual, relu", EPILOGUES,
                         ids=["norm", "norm-relu", "norm-residual-relu", "relu"])
@pytest.mark.parametrize("kind", ["submanifold", "strided", "transposed"])
@pytest.mark.parametrize("channels", ((3, 17), (24, 40), (64, 64)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize(("name", "dtype"), supported(CONV))
def test_a_fused_epilogue_equals_the_convolution_then_the_epilogue(name, dtype, channels, kind, with_norm,
                                                                   with_residual, relu):
    cupy = cupy_module()
    algorithm = get_algorithm(name)
    kernel_map = gpu_map(kind)
    x, w, dy = inputs(kernel_map, *channels, dtype, seed=7)
    scale, shift, residual = epilogue_inputs(kernel_map.num_out, channels[1], dtype, 8, with_norm, with_residual)
    arrays = execution.core_arrays()
    argument = algorithm_argument(name, CONV, "forward")
    x_gpu, w_gpu = cupy.asarray(x), cupy.asarray(w)
    epilogue = ConvEpilogue(*(None if a is None else cupy.asarray(a) for a in (scale, shift, residual)), relu)
    plain_before = execution.forward(arrays, x_gpu, w_gpu, kernel_map, argument).get()
    fused = execution.fused_forward(arrays, x_gpu, w_gpu, kernel_map, argument, epilogue)
    plain_after = execution.forward(arrays, x_gpu, w_gpu, kernel_map, argument).get()
    np.testing.assert_array_equal(plain_after.view(np.uint8), plain_before.view(np.uint8))
    if not isinstance(algorithm, TensorCoreImplicitGemm):
        assert fused is None, f"{name} has no epilogue: the caller applies it"
        return
    conv64, (terms, a, b) = reference_phase("forward", kernel_map, x, w, dy)
    expected = reference(conv64, scale, shift, residual, relu)
    largest_scale = 1.0 if scale is None else float(np.abs(scale).max())
    got = fused.get()
    assert got.dtype == np.dtype(dtype) and got.shape == expected.shape
    # The accumulation error of the convolution, scaled by the norm, and one rounding to the dtype.
    assert_close(got, expected, dtype, terms, a, b * largest_scale,
                 f"{name} {kind} {channels} epilogue norm={with_norm} residual={with_residual} relu={relu}")
    if relu:
        assert (got >= 0).all()


def test_an_epilogue_unlike_the_output_is_refused_by_name():
    cupy = cupy_module()
    kernel_map = gpu_map("submanifold")
    x, w, _ = inputs(kernel_map, 16, 32, np.float16, seed=1)
    argument = algorithm_argument("mma_implicit_gemm", CONV, "forward")
    arrays = execution.core_arrays()
    x_gpu, w_gpu = cupy.asarray(x), cupy.asarray(w)
    wrong = {
        "scale": ConvEpilogue(cupy.ones(32, np.float16), cupy.zeros(32, np.float32)),
        "shift": ConvEpilogue(cupy.ones(32, np.float32), cupy.zeros(31, np.float32)),
        "residual": ConvEpilogue(residual=cupy.zeros((kernel_map.num_out, 32), np.float32)),
    }
    for name, epilogue in wrong.items():
        with pytest.raises(ValueError, match=f"epilogue's {name}"):
            execution.fused_forward(arrays, x_gpu, w_gpu, kernel_map, argument, epilogue)
