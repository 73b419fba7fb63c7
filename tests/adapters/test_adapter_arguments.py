"""Strict arguments at the adapters' entry points: the torch modules and functions, torch pooling, and
JAX's functions and layers.

Channel counts are positive ints (a Python or NumPy integer, never a bool, a float, a string or None);
kernel sizes, strides and dilations are ints or D of them. A wrong one is a TypeError (or, for a
non-positive count, a ValueError) naming the argument and what it got, raised when a module is built
or a function called, never a framework's error from deep inside (`size failed to unpack`,
`'<' not supported`). A kernel too large for the host's memory raises a MemoryError naming its sizes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cupysparse.adapters import jax as cj  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402

NOT_COUNTS = [
    (3.0, TypeError, "3.0 (float)"),  # torch: "empty(): argument 'size' failed to unpack"
    (None, TypeError, "None (NoneType)"),  # torch: "'<' not supported between 'NoneType' and 'int'"
    ("8", TypeError, "'8' (str)"),  # torch: "'<' not supported between 'str' and 'int'"
    (True, TypeError, "True (bool)"),  # torch: a one-channel layer
    (0, ValueError, "0"),
]
NOT_INTS = [
    ("333", "'333' (str)"),  # once (3, 3, 3)
    ([3.7, 3.2, 3.9], "[3.7, 3.2, 3.9] (a list holding a float)"),  # once (3, 3, 3)
    (True, "True (bool)"),  # once (1, 1, 1)
    (3.0, "3.0 (float)"),  # once "'float' object is not iterable"
]
# 300 per axis over 1000 rows: 27 million offsets, terabytes of pair table and query on the CPU.
HUGE_KERNEL_SIZES = r"kernel size \(300, 300, 300\) \(27,000,000 offsets\) over 1,000 output rows"


def count_message(name: str, described: str) -> str:
    return re.escape(f"{name} must be a positive int, got {described}")


def not_an_int_message(name: str, described: str, wanted: str = "an int or 3 ints") -> str:
    return re.escape(f"{name} must be {wanted}, got {described}")


def coordinates(num_rows: int = 10) -> np.ndarray:
    coords = np.zeros((num_rows, 4), dtype=np.int32)
    coords[:, 1] = np.arange(num_rows)
    return coords


def torch_tensor(num_rows: int = 10, channels: int = 2) -> cst.SparseTensor:
    return cst.SparseTensor(torch.from_numpy(coordinates(num_rows)), torch.ones(num_rows, channels))


def jax_tensor(num_rows: int = 10) -> cj.SparseTensor:
    return cj.SparseTensor(coordinates(num_rows), jnp.ones((num_rows, 2), jnp.float32))


@pytest.fixture(autouse=True)
def jax_on_its_cpu():
    """JAX's CPU device even where the default is a GPU: the NumPy path is the one under test."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


# --- torch: channel counts ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "error", "described"), NOT_COUNTS)
@pytest.mark.parametrize("module", [cst.SubMConv3d, cst.SparseConv3d, cst.SparseConvTranspose3d, cst.SubMConv2d])
def test_torch_convolutions_name_a_channel_count_that_is_not_a_positive_int(module, value, error, described):
    with pytest.raises(error, match=count_message("in_channels", described)):
        module(value, 4, 3)
    with pytest.raises(error, match=count_message("out_channels", described)):
        module(4, value, 3)


@pytest.mark.parametrize(("value", "error", "described"), NOT_COUNTS)
def test_torch_depthwise_convolution_names_a_channel_count_that_is_not_a_positive_int(value, error, described):
    with pytest.raises(error, match=count_message("channels", described)):
        cst.SparseDepthwiseConv(value, 3)


def test_torch_modules_take_numpy_channel_counts_as_ints():
    conv = cst.SubMConv3d(np.int64(4), np.int32(8), 3)
    assert (conv.in_channels, conv.out_channels) == (4, 8) and type(conv.in_channels) is int
    assert tuple(conv.weight.shape) == (27, 4, 8)
    assert cst.SparseDepthwiseConv(np.int64(5), 3).channels == 5


# --- torch: kernel sizes, strides, dilations -------------------------------------------------------------


@pytest.mark.parametrize(("value", "described"), NOT_INTS)
@pytest.mark.parametrize("argument", ["kernel_size", "stride", "dilation"])
def test_torch_convolution_modules_name_the_argument_that_is_not_an_int(argument, value, described):
    geometry = {"kernel_size": 3, "stride": 1, "dilation": 1, argument: value}
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cst.SpatiallySparseConv(2, 4, **geometry)
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cst.SparseDepthwiseConv(2, **geometry)


@pytest.mark.parametrize(("value", "described"), NOT_INTS)
def test_torch_functions_name_a_kernel_size_that_is_not_an_int(value, described):
    x = torch_tensor()
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", described)):
        cst.sparse_conv(x, torch.ones(27, 2, 4), value)
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", described)):
        cst.sparse_depthwise_conv(x, torch.ones(27, 2), value)
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", described)):
        cst.sparse_max_pool(x, value)


def test_torch_functions_check_a_float_equal_to_the_int_of_an_earlier_call():
    x = torch_tensor()
    cst.sparse_conv(x, torch.ones(27, 2, 4), 3)
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", "3.0 (float)")):
        cst.sparse_conv(x, torch.ones(27, 2, 4), 3.0)
    with pytest.raises(TypeError, match=not_an_int_message("dilation", "True (bool)")):
        cst.sparse_conv(x, torch.ones(27, 2, 4), 3, dilation=True)


def test_torch_pooling_modules_check_their_arguments_when_built():
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", "'333' (str)", "an int or ints")):
        cst.SparseMaxPool("333")
    with pytest.raises(TypeError, match=not_an_int_message("stride", "2.0 (float)", "an int or ints")):
        cst.SparseAvgPool(2, stride=2.0)
    with pytest.raises(TypeError, match=not_an_int_message("dilation", "None (NoneType)", "an int or ints")):
        cst.SparseMaxPool(2, dilation=None)
    with pytest.raises(TypeError, match=not_an_int_message("stride", "True (bool)", "an int or ints")):
        cst.SparseUnpool(True)
    with pytest.raises(ValueError, match=re.escape("kernel_size must be positive, got (2, 0, 2)")):
        cst.SparseMaxPool((2, 0, 2))


def test_torch_pooling_modules_keep_their_arguments_for_inputs_of_any_dimension():
    coords = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 0, 3]], dtype=torch.int32)  # D = 2
    x = cst.SparseTensor(coords, torch.ones(3, 2))
    assert cst.SparseMaxPool(2)(x).tensor_stride == (2, 2)
    assert cst.SparseAvgPool((2, 1))(x).tensor_stride == (2, 1)


def test_torch_module_with_a_kernel_too_large_for_the_host_raises_naming_its_sizes():
    """300 per axis, stride 1: 27 million offsets over 1000 rows is terabytes on the CPU; raised before
    allocating."""
    pool = cst.SparseMaxPool(300, stride=1)
    with pytest.raises(MemoryError, match=HUGE_KERNEL_SIZES):
        pool(torch_tensor(1000))


# --- JAX -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "error", "described"), NOT_COUNTS)
def test_jax_layers_name_a_channel_count_that_is_not_a_positive_int(value, error, described):
    with pytest.raises(error, match=count_message("in_channels", described)):
        cj.SparseConv(value, 4, 3)
    with pytest.raises(error, match=count_message("out_channels", described)):
        cj.SparseConv(4, value, 3)
    with pytest.raises(error, match=count_message("channels", described)):
        cj.SparseDepthwiseConv(value, 3)
    with pytest.raises(error, match=count_message("channels", described)):
        cj.LayerNorm(value)


def test_jax_layers_take_numpy_channel_counts():
    assert cj.SparseConv(np.int64(4), 8, 3).weight_shape == (27, 4, 8)


@pytest.mark.parametrize(("value", "described"), NOT_INTS)
@pytest.mark.parametrize("argument", ["kernel_size", "stride", "dilation"])
def test_jax_layers_name_the_argument_that_is_not_an_int(argument, value, described):
    geometry = {"kernel_size": 3, "stride": 1, "dilation": 1, argument: value}
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cj.SparseConv(2, 4, **geometry)
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cj.SparseDepthwiseConv(2, **geometry)


@pytest.mark.parametrize(("value", "described"), NOT_INTS)
@pytest.mark.parametrize("argument", ["kernel_size", "stride", "dilation"])
def test_jax_functions_name_the_argument_that_is_not_an_int(argument, value, described):
    x = jax_tensor()
    geometry = {"kernel_size": 3, "stride": 1, "dilation": 1, argument: value}
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cj.conv(x, jnp.ones((27, 2, 4)), **geometry)
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        cj.depthwise_conv(x, jnp.ones((27, 2)), **geometry)


def test_jax_function_with_a_kernel_too_large_for_the_host_raises_naming_its_sizes():
    with pytest.raises(MemoryError, match=HUGE_KERNEL_SIZES):
        cj.conv(jax_tensor(1000), jnp.ones((1, 2, 4)), 300)  # the map raises before the weight is looked at
