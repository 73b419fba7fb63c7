"""The JAX adapter: `jit(grad(...))` of sparse convolutions against the NumPy core and a brute force.

CPU: submanifold, strided, transposed, generative and depthwise convolutions, through both
implementations ("jnp", the CPU path; "core", the core's NumPy algorithms through
`buffer_callback`, the plumbing the GPU path uses), equal the core's `explicit_gemm` in fp64, and
small cases equal a pair-by-pair brute force written from the definitions; lower precisions stay
within the fp64 bounds of `tolerances`; layers, pytrees and errors. CPU tests pin JAX to its CPU
device, so they test the same paths on a GPU machine.
GPU (`pytest -m gpu`): features on a JAX GPU (maps in CuPy, kernels on XLA's stream) against the
fp64 CPU reference over the same pair table, within the fp32 / fp16 / bf16 bounds.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from cupysparse.adapters import jax as cj  # noqa: E402
from cupysparse.functional import convolution as functional  # noqa: E402
from cupysparse.geometry.kernel_map import KernelMap  # noqa: E402
from tolerances import assert_close  # noqa: E402

# The GPU tests share the GPU between JAX and CuPy: keep JAX from preallocating most of it. JAX
# reads this when it first touches a device, not at import; a value already set wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GPU = (pytest.mark.gpu,)


def gpu_test(test):
    for mark in GPU:
        test = mark(test)
    return test


@pytest.fixture(autouse=True)
def jax_cpu_unless_gpu_test(request):
    """CPU tests run on JAX's CPU device even where the default device is a GPU."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here (install jax with its CUDA plugin)")


def coordinates(dims: int = 3, side: int = 6, batch_size: int = 2, density: float = 0.35, seed: int = 0):
    """Unique int32 voxels in [-side/2, side/2)^D per batch item, none empty."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in range(batch_size):
        cells = np.argwhere(rng.random((side,) * dims) < density) - side // 2
        cells = cells if len(cells) else np.zeros((1, dims), dtype=np.int64)
        rows.append(np.concatenate([np.full((len(cells), 1), batch), cells], axis=1))
    return np.concatenate(rows).astype(np.int32)


@dataclass(frozen=True)
class Case:
    kind: str  # submanifold | strided | transposed | generative
    kernel_size: int
    stride: int = 1
    dims: int = 3
    dilation: int = 1

    def __str__(self):
        return f"{self.kind}-D{self.dims}-k{self.kernel_size}-s{self.stride}-d{self.dilation}"

    @property
    def conv_args(self) -> tuple:
        """(kernel_size, stride, dilation, transposed, generative)."""
        transposed = self.kind in ("transposed", "generative")
        return self.kernel_size, self.stride, self.dilation, transposed, self.kind == "generative"


CASES = [
    Case("submanifold", 3),
    Case("submanifold", 3, dims=2, dilation=2),
    Case("strided", 2, 2),
    Case("strided", 3, 2),
    Case("transposed", 2, 2),
    Case("transposed", 3, 2),
    Case("generative", 2, 2),
]
DEPTHWISE_CASES = [Case("submanifold", 3), Case("strided", 2, 2), Case("transposed", 2, 2)]


def make_input(case: Case, channels: int, dtype, seed: int = 0, device=None) -> cj.SparseTensor:
    """The input of `case`: voxels at stride 1, or at stride `case.stride` for a transposed convolution
    (the downsampled coordinates, so it returns to the fine ones) and a generative one."""
    rng = np.random.default_rng(seed + 100)
    coords = coordinates(case.dims, seed=seed)
    put = (lambda a: jax.device_put(a, device)) if device is not None else jnp.asarray
    stride = case.stride if case.kind == "generative" else 1
    tensor = cj.SparseTensor(put(coords), put(rng.standard_normal((len(coords), channels)).astype(dtype)), stride)
    if case.kind != "transposed":
        return tensor
    _, coarse = tensor.kernel_map(case.stride, case.stride)
    return cj.SparseTensor.on(coarse, put(rng.standard_normal((coarse.num_points, channels)).astype(dtype)))


def value_and_grads(convolve, x: cj.SparseTensor, weight, grad_output):
    """Under jit: convolve(x, weight) features and the gradients of Σ grad_output · output."""

    def loss(features, weight):
        out = convolve(x.replace_features(features), weight).features
        return jnp.sum(grad_output * out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x.features, weight)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


def random(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


# --- against the NumPy core ---------------------------------------------------------------


@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_jit_grad_equals_the_numpy_core(case, impl, x64):
    x = make_input(case, channels=3, dtype=np.float64)
    kernel_map, out_geometry = x.kernel_map(*case.conv_args)
    weight = random((kernel_map.kernel_volume, 3, 4), np.float64, 1)
    grad_output = random((kernel_map.num_out, 4), np.float64, 2)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.conv(t, w, *case.conv_args, impl=impl), x, weight, grad_output
    )
    features, w, g = (np.asarray(a) for a in (x.features, weight, grad_output))
    expected = functional.conv_forward(features, w, kernel_map, "explicit_gemm")
    expected_input, expected_weight = functional.conv_backward(g, features, w, kernel_map, "explicit_gemm")
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_input, expected_input, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_weight, expected_weight, rtol=1e-12, atol=1e-12)
    assert out.shape[0] == out_geometry.num_points


@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", DEPTHWISE_CASES, ids=str)
def test_depthwise_jit_grad_equals_the_numpy_core(case, impl, x64):
    x = make_input(case, channels=5, dtype=np.float64, seed=3)
    kernel_map, _ = x.kernel_map(*case.conv_args)
    weight = random((kernel_map.kernel_volume, 5), np.float64, 4)
    grad_output = random((kernel_map.num_out, 5), np.float64, 5)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.depthwise_conv(t, w, *case.conv_args, impl=impl), x, weight, grad_output
    )
    features, w, g = (np.asarray(a) for a in (x.features, weight, grad_output))
    expected = functional.spatially_sparse_depthwise_conv(features, w, kernel_map, kernel_map.num_out, "explicit")
    expected_input, expected_weight = functional.spatially_sparse_depthwise_conv_backward(
        g, features, w, kernel_map, "explicit"
    )
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_input, expected_input, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_weight, expected_weight, rtol=1e-12, atol=1e-12)


# --- against a brute force written from the definitions ------------------------------------


def kernel_offsets(size: int, dims: int) -> list[tuple[int, ...]]:
    """Lexicographic, first axis slowest; -r..r for odd sizes, 0..1 for size 2."""
    return list(itertools.product(range(-((size - 1) // 2), size // 2 + 1), repeat=dims))


def brute_force(case: Case, in_coords, out_coords, x, weight, grad_output):
    """(output, input gradient, weight gradient), pair by pair from coordinate dictionaries.

    Submanifold and strided: input `q·stride + o_k` feeds output q; transposed: input c feeds
    output `c·stride + o_k` (coordinates in units of each tensor's own stride)."""
    in_rows = {tuple(c): i for i, c in enumerate(in_coords.tolist())}
    out_rows = {tuple(c): i for i, c in enumerate(out_coords.tolist())}
    pairs = []
    for k, offset in enumerate(kernel_offsets(case.kernel_size, case.dims)):
        if case.kind == "transposed":
            for j, (batch, *c) in enumerate(in_coords.tolist()):
                target = (batch, *(v * case.stride + o for v, o in zip(c, offset)))
                if target in out_rows:
                    pairs.append((k, j, out_rows[target]))
        else:
            for i, (batch, *q) in enumerate(out_coords.tolist()):
                source = (batch, *(v * case.stride + case.dilation * o for v, o in zip(q, offset)))
                if source in in_rows:
                    pairs.append((k, in_rows[source], i))
    out = np.zeros((len(out_coords), weight.shape[2]))
    grad_input, grad_weight = np.zeros_like(x), np.zeros_like(weight)
    for k, j, i in pairs:
        out[i] += x[j] @ weight[k]
        grad_input[j] += weight[k] @ grad_output[i]
        grad_weight[k] += np.outer(x[j], grad_output[i])
    return out, grad_input, grad_weight


@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "case", [Case("submanifold", 3), Case("strided", 2, 2), Case("transposed", 2, 2)], ids=str
)
def test_jit_grad_equals_a_brute_force(case, impl, x64):
    x = make_input(case, channels=2, dtype=np.float64, seed=7)
    _, out_geometry = x.kernel_map(*case.conv_args)
    in_coords, out_coords = np.asarray(x.coordinates), np.asarray(out_geometry.coordinates)
    fine = np.asarray(x.geometry.map_cache.coordinates((1, 1, 1)))
    expected_sites = {
        "submanifold": fine,
        "strided": np.concatenate([fine[:, :1], np.floor_divide(fine[:, 1:], case.stride)], axis=1),
        "transposed": fine,
    }[case.kind]
    assert {tuple(c) for c in out_coords.tolist()} == {tuple(c) for c in expected_sites.tolist()}
    assert len(out_coords) == len({tuple(c) for c in out_coords.tolist()})
    weight = random((case.kernel_size**case.dims, 2, 3), np.float64, 8)
    grad_output = random((len(out_coords), 3), np.float64, 9)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.conv(t, w, *case.conv_args, impl=impl), x, weight, grad_output
    )
    expected = brute_force(case, in_coords, out_coords, np.asarray(x.features), np.asarray(weight),
                           np.asarray(grad_output))
    for got, want, what in zip((out, grad_input, grad_weight), expected, ("output", "input grad", "weight grad")):
        assert np.abs(want).max() > 0, what
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=what)


# --- lower precisions, empty tensors ------------------------------------------------------


@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lower_precisions_stay_within_the_fp64_bounds(dtype, impl):
    case = Case("submanifold", 3)
    dtype = jnp.dtype(dtype)
    x = make_input(case, channels=8, dtype=np.float32, seed=11)
    x = x.replace_features(x.features.astype(dtype))
    kernel_map, _ = x.kernel_map(3)
    weight = random((27, 8, 6), np.float32, 12).astype(dtype)
    grad_output = random((kernel_map.num_out, 6), np.float32, 13).astype(dtype)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.conv(t, w, 3, impl=impl), x, weight, grad_output
    )
    assert out.dtype == grad_input.dtype == grad_weight.dtype == dtype
    features, w, g = (np.asarray(a).astype(np.float64) for a in (x.features, weight, grad_output))
    expected = functional.conv_forward(features, w, kernel_map)
    expected_input, expected_weight = functional.conv_backward(g, features, w, kernel_map)
    assert_close(out, expected, dtype, 27 * 8, features, w, "forward")
    assert_close(grad_input, expected_input, dtype, 27 * 6, g, w, "dgrad")
    assert_close(grad_weight, expected_weight, dtype, kernel_map.num_out, features, g, "wgrad")


@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
def test_an_empty_tensor_gives_empty_outputs_and_zero_weight_gradients(impl):
    x = cj.SparseTensor(np.zeros((0, 4), np.int32), jnp.zeros((0, 3)))
    weight = jnp.ones((8, 3, 2))
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.conv(t, w, 2, 2, impl=impl), x, weight, jnp.zeros((0, 2))
    )
    assert out.shape == (0, 2) and grad_input.shape == (0, 3)
    np.testing.assert_array_equal(grad_weight, np.zeros((8, 3, 2)))


# --- pytrees and tracing ------------------------------------------------------------------


def test_a_sparse_tensor_is_a_pytree_with_a_static_geometry():
    x = make_input(Case("submanifold", 3), channels=3, dtype=np.float32)
    weight = random((27, 3, 2), np.float32, 0)
    traces = []

    @jax.jit
    def forward(x, weight):
        traces.append(1)
        return cj.conv(x, weight, 3)

    first = forward(x, weight)
    second = forward(x.replace_features(x.features * 2), weight)
    assert len(traces) == 1  # same geometry: the trace and its kernel map are reused
    assert isinstance(first, cj.SparseTensor) and first.geometry == x.geometry
    np.testing.assert_allclose(second.features, 2 * first.features, rtol=1e-6)
    forward(make_input(Case("submanifold", 3), channels=3, dtype=np.float32, seed=1), weight)
    assert len(traces) == 2  # new coordinates: new shapes, new trace
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 1 and jax.tree_util.tree_unflatten(treedef, leaves).geometry == x.geometry


# --- layers -------------------------------------------------------------------------------


def test_layer_init_shapes_and_fan_in_scale():
    layer = cj.SparseConv(32, 64, 3)
    params = layer.init(jax.random.key(0))
    assert params["weight"].shape == (27, 32, 64) and params["weight"].dtype == jnp.float32
    np.testing.assert_array_equal(params["bias"], np.zeros(64))
    assert abs(float(params["weight"].std()) / math.sqrt(2 / (27 * 32)) - 1) < 0.03
    assert "bias" not in cj.SparseConv(4, 4, 3, bias=False).init(jax.random.key(0))
    assert cj.SparseConv(16, 8, 2, stride=2, transposed=True).fan_in == 16  # one offset per output
    assert cj.SparseDepthwiseConv(8, 3, spatial_dims=2).init(jax.random.key(1))["weight"].shape == (9, 8)


def test_relu_and_layer_norm():
    x = make_input(Case("submanifold", 3), channels=6, dtype=np.float32)
    np.testing.assert_array_equal(cj.relu(x).features, np.maximum(np.asarray(x.features), 0))
    norm = cj.LayerNorm(6)
    normalised = np.asarray(norm.apply(norm.init(), x).features)
    np.testing.assert_allclose(normalised.mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(normalised.var(axis=1), 1, rtol=1e-3)


def test_a_sparse_unet_block_differentiates_under_jit(x64):
    f64 = jnp.float64
    layers = {
        "enc": cj.SparseConv(3, 8, 3, dtype=f64),
        "norm": cj.LayerNorm(8, dtype=f64),
        "down": cj.SparseConv(8, 16, 2, stride=2, dtype=f64),
        "mid": cj.SparseDepthwiseConv(16, 3, dtype=f64),
        "up": cj.SparseConv(16, 8, 2, stride=2, transposed=True, dtype=f64),
        "head": cj.SparseConv(16, 2, 1, dtype=f64),
    }
    keys = jax.random.split(jax.random.key(0), len(layers))
    params = {name: layer.init(key) for (name, layer), key in zip(layers.items(), keys)}

    def block(params, x):
        skip = cj.relu(layers["norm"].apply(params["norm"], layers["enc"].apply(params["enc"], x)))
        coarse = cj.relu(layers["mid"].apply(params["mid"], layers["down"].apply(params["down"], skip)))
        return layers["head"].apply(params["head"], cj.cat(skip, layers["up"].apply(params["up"], coarse)))

    x = make_input(Case("submanifold", 3), channels=3, dtype=np.float64, seed=5)
    out = jax.jit(block)(params, x)
    assert out.geometry == x.geometry and out.num_channels == 2
    maps_built = len(x.geometry.map_cache)
    loss = jax.jit(lambda params, features: jnp.sum(block(params, x.replace_features(features)).features ** 2))
    # A small step, so the finite differences do not cross a ReLU kink (at 1e-4 some do).
    check_grads(loss, (params, x.features), order=1, modes=("rev",), eps=1e-6)
    assert len(x.geometry.map_cache) == maps_built  # every map was built once, on the first trace


# --- errors -------------------------------------------------------------------------------


def test_bad_tensors_raise_naming_the_argument():
    coords = coordinates()
    features = jnp.ones((len(coords), 3))
    with pytest.raises(TypeError, match="coordinates must be int32"):
        cj.SparseTensor(coords.astype(np.float32), features)
    with pytest.raises(TypeError, match="features must be float64, float32, float16 or bfloat16"):
        cj.SparseTensor(coords, jnp.ones((len(coords), 3), jnp.int32))
    with pytest.raises(ValueError, match=rf"features must have shape \[{len(coords)}, C\]"):
        cj.SparseTensor(coords, jnp.ones((len(coords) + 1, 3)))
    with pytest.raises(ValueError, match="coordinates: duplicate"):
        cj.SparseTensor(np.concatenate([coords, coords[:1]]), jnp.ones((len(coords) + 1, 3)))
    with pytest.raises(TypeError, match="features is traced"):
        jax.jit(lambda f: cj.SparseTensor(coords, f).features)(features)
    other = cj.SparseTensor(coords, features)
    with pytest.raises(ValueError, match="same coordinates"):
        cj.cat(other, cj.SparseTensor(coords, features))


@pytest.mark.parametrize(
    ("weight_shape", "dtype", "error", "match"),
    [
        ((27, 3, 2), jnp.int32, TypeError, "weight has dtype int32"),
        ((26, 3, 2), jnp.float32, ValueError, "weight has 26 kernel offsets"),
        ((27, 4, 2), jnp.float32, ValueError, "weight expects 4 input channels, features has 3"),
        ((27, 3), jnp.float32, ValueError, r"weight must have shape \[K, C_in, C_out\]"),
    ],
)
def test_bad_weights_raise_naming_the_argument(weight_shape, dtype, error, match):
    x = make_input(Case("submanifold", 3), channels=3, dtype=np.float32)
    with pytest.raises(error, match=match):
        cj.conv(x, jnp.ones(weight_shape, dtype), 3)
    with pytest.raises(error, match=match):  # the same checks hold under jit, on abstract values
        jax.jit(lambda f: cj.conv(x.replace_features(f), jnp.ones(weight_shape, dtype), 3).features)(x.features)


def test_other_bad_arguments_raise():
    x = make_input(Case("submanifold", 3), channels=3, dtype=np.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \[K=27, C=3\]"):
        cj.depthwise_conv(x, jnp.ones((27, 4)), 3)
    with pytest.raises(ValueError, match=r"bias must have shape \[2\]"):
        cj.conv(x, jnp.ones((27, 3, 2)), 3, bias=jnp.ones(3))
    with pytest.raises(ValueError, match="impl must be one of"):
        cj.conv(x, jnp.ones((27, 3, 2)), 3, impl="cuda")
    with pytest.raises(ValueError, match="explicit_gemm"):
        cj.conv(x, jnp.ones((27, 3, 2)), 3, fwd_algo="explicit_gem")
    with pytest.raises(TypeError, match="input must be a cupysparse.adapters.jax.SparseTensor"):
        cj.conv(x.features, jnp.ones((27, 3, 2)), 3)
    with pytest.raises(TypeError, match="kernel_map must be a cupysparse KernelMap"):
        cj.sparse_conv(x.features, jnp.ones((27, 3, 2)), "map")
    layer = cj.SparseConv(3, 2, 3)
    with pytest.raises(ValueError, match=r"params\['weight'\] has shape \(27, 4, 2\)"):
        layer.apply(cj.SparseConv(4, 2, 3).init(jax.random.key(0)), x)
    with pytest.raises(ValueError, match="in_channels must be a positive int"):
        cj.SparseConv(0, 2, 3)


# --- GPU ----------------------------------------------------------------------------------

GPU_DTYPES = ("float32", "float16", "bfloat16")


def cpu_copy(kernel_map: KernelMap) -> KernelMap:
    return KernelMap(
        kernel_map.pair_table.get(), kernel_map.num_in, kernel_map.kernel_size, kernel_map.stride,
        kernel_map.dilation, kernel_map.transposed, kernel_map.generative,
    )


def gpu_input(case: Case, channels: int, dtype, device, seed: int = 0) -> cj.SparseTensor:
    """Like make_input, with rounding to `dtype` and everything (coordinates too) on the JAX GPU."""
    tensor = make_input(case, channels, np.float32, seed, device)
    assert tensor.geometry.device == "cuda"  # JAX GPU features: the maps were built by CuPy
    return tensor.replace_features(tensor.features.astype(dtype))


@gpu_test
@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", [Case("submanifold", 3), Case("strided", 2, 2), Case("transposed", 2, 2)], ids=str)
def test_gpu_jit_grad_matches_the_fp64_cpu_reference(case, dtype, impl, jax_gpu):
    x = gpu_input(case, 16, dtype, jax_gpu)
    kernel_map, _ = x.kernel_map(*case.conv_args)
    weight = jax.device_put(random((kernel_map.kernel_volume, 16, 24), np.float32, 1).astype(dtype), jax_gpu)
    grad_output = jax.device_put(random((kernel_map.num_out, 24), np.float32, 2).astype(dtype), jax_gpu)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.conv(t, w, *case.conv_args, impl=impl), x, weight, grad_output
    )
    assert out.dtype == grad_input.dtype == grad_weight.dtype == jnp.dtype(dtype)
    features, w, g = (np.asarray(a).astype(np.float64) for a in (x.features, weight, grad_output))
    reference_map = cpu_copy(kernel_map)
    expected = functional.conv_forward(features, w, reference_map, "explicit_gemm")
    expected_input, expected_weight = functional.conv_backward(g, features, w, reference_map, "explicit_gemm")
    volume = kernel_map.kernel_volume
    assert_close(out, expected, dtype, volume * 16, features, w, "forward")
    assert_close(grad_input, expected_input, dtype, volume * 24, g, w, "dgrad")
    assert_close(grad_weight, expected_weight, dtype, kernel_map.num_out, features, g, "wgrad")


@gpu_test
@pytest.mark.parametrize("impl", cj.IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", [Case("submanifold", 3), Case("strided", 2, 2)], ids=str)
def test_gpu_depthwise_matches_the_fp64_cpu_reference(case, dtype, impl, jax_gpu):
    x = gpu_input(case, 24, dtype, jax_gpu, seed=3)
    kernel_map, _ = x.kernel_map(*case.conv_args)
    weight = jax.device_put(random((kernel_map.kernel_volume, 24), np.float32, 4).astype(dtype), jax_gpu)
    grad_output = jax.device_put(random((kernel_map.num_out, 24), np.float32, 5).astype(dtype), jax_gpu)
    out, (grad_input, grad_weight) = value_and_grads(
        lambda t, w: cj.depthwise_conv(t, w, *case.conv_args, impl=impl), x, weight, grad_output
    )
    features, w, g = (np.asarray(a).astype(np.float64) for a in (x.features, weight, grad_output))
    reference_map = cpu_copy(kernel_map)
    expected = functional.spatially_sparse_depthwise_conv(features, w, reference_map, kernel_map.num_out, "explicit")
    expected_input, expected_weight = functional.spatially_sparse_depthwise_conv_backward(
        g, features, w, reference_map, "explicit"
    )
    volume = kernel_map.kernel_volume
    assert_close(out, expected, dtype, volume, features, w, "forward")
    assert_close(grad_input, expected_input, dtype, volume, g, w, "dgrad")
    assert_close(grad_weight, expected_weight, dtype, kernel_map.num_out, features, g, "wgrad")


@gpu_test
def test_gpu_unet_block_matches_the_cpu_run(jax_gpu):
    layers = {
        "enc": cj.SparseConv(3, 16, 3),
        "down": cj.SparseConv(16, 16, 2, stride=2),
        "up": cj.SparseConv(16, 16, 2, stride=2, transposed=True),
        "head": cj.SparseConv(32, 4, 3),
    }
    keys = jax.random.split(jax.random.key(0), len(layers))
    params = {name: layer.init(key) for (name, layer), key in zip(layers.items(), keys)}

    def loss(params, x):
        skip = cj.relu(layers["enc"].apply(params["enc"], x))
        up = layers["up"].apply(params["up"], cj.relu(layers["down"].apply(params["down"], skip)))
        out = layers["head"].apply(params["head"], cj.cat(skip, up)).features
        return jnp.sum(out**2), out

    results = {}
    for device in (jax_gpu, jax.devices("cpu")[0]):
        x = make_input(Case("submanifold", 3), 3, np.float32, seed=6, device=device)
        assert x.geometry.device == ("cuda" if device is jax_gpu else "cpu")
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(jax.device_put(params, device), x)
        results[device.platform] = jax.tree_util.tree_map(np.asarray, (out, grads))
    gpu_leaves, cpu_leaves = (jax.tree_util.tree_leaves(results[p]) for p in ("gpu", "cpu"))
    for got, want in zip(gpu_leaves, cpu_leaves):
        # fp32 through four layers: rounding differences of ~1e-6 relative, far below this bound.
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
