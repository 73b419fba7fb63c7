"""Strict integer arguments and a memory estimate before a kernel map grows with its kernel volume.

Kernel sizes, strides and dilations are ints (Python or NumPy integers, never bools, floats or strings)
or D of them, checked by `coords.as_tuple` wherever they enter the core: a wrong one is a TypeError that
names the argument and what it got. A kernel map whose host memory grows with the kernel volume (its
offsets, on the CPU its pair table and query, a generative convolution's candidates) raises a
MemoryError naming its sizes before allocating, in well under a second, instead of filling the memory.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from cupysparse.functional.convolution import spatially_sparse_conv
from cupysparse.functional.pooling import sparse_max_pool, sparse_unpool
from cupysparse.geometry import coords as coords_module
from cupysparse.geometry.coords import as_tuple, kernel_offsets
from cupysparse.geometry.kernel_map import generative_coordinates, generative_map, strided_map, submanifold_map
from cupysparse.geometry.sparse_tensor import SparseTensor

# Values once read as a kernel size, stride or dilation, with what each now names in its TypeError.
NOT_INTS = [
    ("333", "'333' (str)"),  # once (3, 3, 3): a string of digits
    ([3.7, 3.2, 3.9], "[3.7, 3.2, 3.9] (a list holding a float)"),  # once truncated to (3, 3, 3)
    (True, "True (bool)"),  # once (1, 1, 1)
    ((3, True, 3), "(3, True, 3) (a tuple holding a bool)"),
    (3.0, "3.0 (float)"),  # once "'float' object is not iterable"
    (np.float64(3), "np.float64(3.0) (float64)"),
    (None, "None (NoneType)"),  # once "'NoneType' object is not iterable"
]
GEOMETRY_ARGUMENTS = ("kernel_size", "stride", "dilation")
SMALL_HOST_BYTES = 2**30  # a host that has 1 GiB available, as the memory tests pretend
SECONDS_TO_RAISE = 5.0  # the check takes microseconds; the unchecked build took minutes


def not_an_int_message(name: str, described: str, spatial_dims: int = 3) -> str:
    return re.escape(f"{name} must be an int or {spatial_dims} ints, got {described}")


def line_of_voxels(num_rows: int, spacing: int = 1) -> np.ndarray:
    """`num_rows` voxels of batch 0 along the first axis, `spacing` apart."""
    coords = np.zeros((num_rows, 4), dtype=np.int32)
    coords[:, 1] = np.arange(num_rows) * spacing
    return coords


def tensor(num_rows: int = 8) -> SparseTensor:
    return SparseTensor(line_of_voxels(num_rows), np.ones((num_rows, 2), dtype=np.float64))


# --- the one check ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "described"), NOT_INTS)
def test_as_tuple_rejects_what_is_not_an_int_naming_the_argument_and_what_it_got(value, described):
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", described)):
        as_tuple(value, 3, "kernel_size")


@pytest.mark.parametrize(("value", "expected"), [
    (3, (3, 3, 3)),
    (np.int64(2), (2, 2, 2)),
    ((1, 2, 3), (1, 2, 3)),
    ([1, np.int32(2), 3], (1, 2, 3)),
    (np.array([3, 1, 2]), (3, 1, 2)),
])
def test_as_tuple_takes_python_and_numpy_ints(value, expected):
    values = as_tuple(value, 3, "stride")
    assert values == expected
    assert all(type(v) is int for v in values)


def test_as_tuple_without_spatial_dims_checks_all_but_the_length():
    assert as_tuple(2, None, "stride") == (2,)
    assert as_tuple((2, 1), None, "stride") == (2, 1)
    with pytest.raises(TypeError, match=re.escape("stride must be an int or ints, got '22' (str)")):
        as_tuple("22", None, "stride")
    with pytest.raises(ValueError, match=re.escape("stride must be an int or ints, got ()")):
        as_tuple((), None, "stride")


# --- where they enter the core ----------------------------------------------------------------------


@pytest.mark.parametrize("argument", GEOMETRY_ARGUMENTS)
@pytest.mark.parametrize(("value", "described"), NOT_INTS)
def test_sparse_tensor_kernel_map_names_the_argument_that_is_not_an_int(argument, value, described):
    geometry = {"kernel_size": 3, "stride": 1, "dilation": 1, argument: value}
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        tensor().kernel_map(**geometry)


@pytest.mark.parametrize(("argument", "value", "described"), [
    ("kernel_size", 3.0, "3.0 (float)"),
    ("kernel_size", (3, 3, 3.0), "(3, 3, 3.0) (a tuple holding a float)"),
    ("stride", True, "True (bool)"),
    ("stride", 1.0, "1.0 (float)"),
    ("dilation", True, "True (bool)"),
])
def test_a_float_or_bool_equal_to_an_earlier_int_meets_the_check_too(argument, value, described):
    """The map cache answers a repeated call from a memo keyed by the arguments, where 3.0 == 3 and
    True == 1 would find the int's entry."""
    x = tensor()
    earlier = {"kernel_size": 3, "stride": 1, "dilation": 1}
    first = x.kernel_map(**earlier)
    with pytest.raises(TypeError, match=not_an_int_message(argument, described)):
        x.kernel_map(**{**earlier, argument: value})
    assert x.kernel_map(**earlier) is first  # the ints themselves still find their map


def test_layers_sharing_a_map_each_find_it_in_the_memo():
    """Every layer of a level holds its own (3, 3, 3): equal tuples of ints answer from the memo, without
    normalising again."""
    x = tensor()
    first_layers_size = (3, 3, 3)
    first = x.kernel_map(kernel_size=first_layers_size)
    other_layers_size = tuple(int(size) for size in "333")
    assert other_layers_size == first_layers_size and other_layers_size is not first_layers_size
    assert x.map_cache.lookup((1, 1, 1), other_layers_size) is first
    assert x.map_cache.lookup((1, 1, 1), (3.0, 3, 3)) is None  # a float among them: checked again


@pytest.mark.parametrize("argument", GEOMETRY_ARGUMENTS)
def test_spatially_sparse_conv_names_the_argument_that_is_not_an_int(argument):
    x = tensor()
    weight = np.ones((27, 2, 4), dtype=np.float64)
    geometry = {"kernel_size": 3, "stride": 1, "dilation": 1, argument: "2"}
    with pytest.raises(TypeError, match=not_an_int_message(argument, "'2' (str)")):
        spatially_sparse_conv(x, weight, **geometry)


def test_pooling_names_the_argument_that_is_not_an_int():
    x = tensor()
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", "2.0 (float)")):
        sparse_max_pool(x, 2.0)
    with pytest.raises(TypeError, match=not_an_int_message("stride", "[2, 2.5, 2] (a list holding a float)")):
        sparse_max_pool(x, 2, stride=[2, 2.5, 2])
    with pytest.raises(TypeError, match=not_an_int_message("stride", "True (bool)")):
        sparse_unpool(x, True)


@pytest.mark.parametrize("build", [
    lambda coords, kernel_size: submanifold_map(coords, kernel_size),
    lambda coords, kernel_size: strided_map(coords, kernel_size, 2),
    lambda coords, kernel_size: generative_map(coords, kernel_size, 2),
])
def test_map_builders_name_a_kernel_size_that_is_not_an_int(build):
    with pytest.raises(TypeError, match=not_an_int_message("kernel_size", "'333' (str)")):
        build(line_of_voxels(4), "333")


# --- memory that grows with the kernel volume ---------------------------------------------------------


def test_a_kernel_of_a_few_hundred_per_axis_raises_at_once_naming_its_sizes():
    """27 million offsets over 1000 rows: terabytes on the CPU, raised before any of it is allocated."""
    start = time.perf_counter()
    sizes = r"kernel size \(300, 300, 300\) \(27,000,000 offsets\) over 1,000 output rows: "
    with pytest.raises(MemoryError, match=sizes + r"about [\d,.]+ GiB of host memory needed \([\d,]+ bytes\)"):
        tensor(1000).kernel_map(300)
    assert time.perf_counter() - start < SECONDS_TO_RAISE


def test_a_kernel_volume_past_int32_raises_a_value_error_naming_it():
    """2^18 + 1 per axis is a valid size, but its 1.8e16 offsets would be listed one by one without end."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"kernel size \(262145, 262145, 262145\) has 18,014,604,668,698,625 offsets, "
                                         r"more than the 2,147,483,647"):
        submanifold_map(line_of_voxels(4), 2**18 + 1)
    assert time.perf_counter() - start < SECONDS_TO_RAISE


def test_one_long_axis_over_many_rows_raises_naming_its_sizes():
    """2^18 + 1 along one axis over 2^15 rows: the CPU query alone would take terabytes."""
    with pytest.raises(MemoryError, match=r"kernel size \(262145, 1, 1\) \(262,145 offsets\) over 32,768 output rows"):
        tensor(2**15).kernel_map((2**18 + 1, 1, 1))


def test_the_estimate_is_measured_against_the_host_memory_available(monkeypatch):
    """The same map raises or not by what the host has: 125 offsets over 12,000 rows need about 0.3 GiB."""
    coords = line_of_voxels(12_000)
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: 2**27)
    with pytest.raises(MemoryError, match=r"\(125 offsets\) over 12,000 output rows: .* than the 0.1 GiB available"):
        submanifold_map(coords, 5)
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: SMALL_HOST_BYTES)
    assert submanifold_map(coords, 5).pair_table.shape == (125, 12_000)


def test_small_maps_do_not_ask_the_host_for_its_memory(monkeypatch):
    def no_query():
        raise AssertionError("a small map's build asked for the host memory")

    monkeypatch.setattr(coords_module, "available_host_memory", no_query)
    assert submanifold_map(line_of_voxels(1000), 3).pair_table.shape == (27, 1000)


def test_generative_candidates_are_estimated_before_they_are_made(monkeypatch):
    """200,000 input rows x 27 offsets: about 0.5 GiB of candidates and their deduplication on the CPU."""
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: 2**28)
    with pytest.raises(MemoryError, match=r"candidates of a generative transposed convolution "
                                          r"\(200000 input rows x 27 offsets\): about [\d.]+ GiB"):
        generative_coordinates(line_of_voxels(200_000), (3, 3, 3), (2, 2, 2), (1, 1, 1))


def test_a_generative_map_checks_its_output_rows_before_querying_them(monkeypatch):
    """1000 voxels far apart, each reaching 729 new ones: the input is small, the output is not."""
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: SMALL_HOST_BYTES)
    with pytest.raises(MemoryError, match=r"\(729 offsets\) over 729,000 output rows"):
        generative_map(line_of_voxels(1000, spacing=10), 9, 9)


def test_the_offsets_alone_are_estimated_on_either_backend(monkeypatch):
    """A kernel's offsets are listed on the host whichever backend builds its map (a GPU's pair table is
    left to its allocator, whose error comes at once): a billion of them need about 90 GiB."""
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: SMALL_HOST_BYTES)
    with pytest.raises(MemoryError, match=r"the 1,000,000,000 offsets of kernel size \(1000, 1000, 1000\): about"):
        coords_module.check_kernel_volume((1000, 1000, 1000))
    coords_module.check_kernel_volume((100, 100, 100))  # about 92 MiB: fits


def test_kernel_offsets_keep_their_order():
    """Listed at once now, not one tuple at a time: still d0 slowest, each axis -r..r (even sizes lean
    positive)."""
    offsets = kernel_offsets((2, 3, 4))
    assert offsets.dtype == np.int32 and offsets.shape == (24, 3)
    expected = [(a, b, c) for a in (0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1, 2)]
    assert [tuple(row) for row in offsets.tolist()] == expected


@pytest.mark.parametrize("tensor_stride", [(4.0, 4, 4), (2.5, 2, 2), (True, 2, 2), "444"])
def test_downsample_to_takes_ints_only(tensor_stride):
    """A float or bool tensor stride was truncated (2.5 → 2) or read as 1; now refused, named."""
    tensor = SparseTensor(np.zeros((1, 4), np.int32), np.zeros((1, 1), np.float32))
    with pytest.raises(TypeError, match="tensor_stride must be an int or 3 ints"):
        tensor.map_cache.downsample_to([tensor_stride])


@pytest.mark.parametrize("origin", [(True, 0, 0), (0.0, 0, 0), (0, 0)])
def test_to_dense_takes_an_origin_of_ints_only(origin):
    """A bool origin was read as 1."""
    tensor = SparseTensor(np.array([[0, 1, 1, 1]], np.int32), np.ones((1, 1), np.float32))
    with pytest.raises(ValueError, match="origin must be 3 ints"):
        tensor.to_dense(origin=origin)
