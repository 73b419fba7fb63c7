"""safetensors weights files: round trips, the byte layout checked by hand, corrupt files, atomic writes.

Files are parsed and built here with `struct` and `json` straight from the format's definition, so
the reader and the writer are each checked against something other than each other.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import struct
import sys

import ml_dtypes
import numpy as np
import pytest

from cupysparse.networks import weights_file
from cupysparse.networks.weights_file import load_metadata, load_weights, save_weights

# The format's dtype names and what they mean, written out independently of the module's table.
SUPPORTED_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

needs_little_endian_host = pytest.mark.skipif(
    sys.byteorder != "little", reason="compares the file's bytes with the host's tobytes()"
)


def random_array(dtype, shape, seed=0) -> np.ndarray:
    """Random bit patterns, so floats include NaN payloads, infinities and subnormals."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def bit_pattern(array: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers: compares NaNs and bf16 exactly."""
    return np.asarray(array).view(f"u{array.dtype.itemsize}")


def assert_same_array(actual, expected) -> None:
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(bit_pattern(actual), bit_pattern(expected))


def write_by_hand(path, header, data: bytes = b"", padding: bytes = b"") -> None:
    """A safetensors file from a header (dict, or raw bytes for malformed ones) and a data buffer."""
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    header_bytes += padding
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def parse_by_hand(path):
    """(header length, header dict, data buffer) of a safetensors file."""
    content = pathlib.Path(path).read_bytes()
    (header_length,) = struct.unpack("<Q", content[:8])
    header_bytes = content[8 : 8 + header_length]
    return header_length, header_bytes, content[8 + header_length :]


# Round trips


@pytest.mark.parametrize("code", SUPPORTED_DTYPES)
def test_every_dtype_round_trips_bit_exactly(tmp_path, code):
    dtype = SUPPORTED_DTYPES[code]
    original = random_array(dtype, (4, 3), seed=len(code)).T  # transposed: must be written in C order
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"weight": original})
    loaded = load_weights(path)
    assert list(loaded) == ["weight"]
    assert_same_array(loaded["weight"], np.ascontiguousarray(original))
    assert loaded["weight"].flags.writeable and loaded["weight"].flags.c_contiguous
    header_length, header_bytes, _ = parse_by_hand(path)
    assert json.loads(header_bytes)["weight"]["dtype"] == code
    assert (8 + header_length) % 8 == 0, "the data buffer must start 8-byte aligned"


def test_many_tensors_of_mixed_dtypes_and_shapes_round_trip_in_one_file(tmp_path):
    tensors = {
        f"layer{index}.{code.lower()}": random_array(dtype, shape, seed=index)
        for index, ((code, dtype), shape) in enumerate(
            zip(SUPPORTED_DTYPES.items(), [(5,), (2, 3), (), (0,), (3, 1, 2), (7,), (2, 0, 3), (1,), (9,), (4, 4)])
        )
    }
    path = tmp_path / "weights.safetensors"
    save_weights(str(path), tensors)
    loaded = load_weights(str(path))
    assert list(loaded) == sorted(tensors)
    for name, original in tensors.items():
        assert_same_array(loaded[name], original)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 2, 5)])
def test_scalars_and_zero_size_arrays_round_trip(tmp_path, shape):
    original = np.full(shape, 2.5, dtype=np.float32)
    neighbour = np.arange(3, dtype=np.int16)  # a tensor after it: the empty one must take no bytes
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"a": original, "b": neighbour})
    loaded = load_weights(path)
    assert_same_array(loaded["a"], original)
    assert_same_array(loaded["b"], neighbour)
    _, header_bytes, data = parse_by_hand(path)
    begin, end = json.loads(header_bytes)["a"]["data_offsets"]
    assert end - begin == original.nbytes
    assert len(data) == original.nbytes + neighbour.nbytes


def test_metadata_round_trips_and_defaults_to_empty(tmp_path):
    metadata = {"format": "pt", "note": "été, 東京, \"quoted\"\nnew line", "": ""}
    with_metadata, without_metadata = tmp_path / "with.safetensors", tmp_path / "without.safetensors"
    save_weights(with_metadata, {"w": np.ones(2, np.float32)}, metadata=metadata)
    save_weights(without_metadata, {"w": np.ones(2, np.float32)})
    assert load_metadata(with_metadata) == metadata
    assert load_metadata(without_metadata) == {}
    assert list(load_weights(with_metadata)) == ["w"]  # the metadata is not taken for a tensor


def test_big_endian_input_is_stored_little_endian_and_loaded_native(tmp_path):
    values = np.array([1.0, -2.5, 1e30], dtype=">f8")
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"x": values})
    _, _, data = parse_by_hand(path)
    assert data == struct.pack("<3d", 1.0, -2.5, 1e30)
    loaded = load_weights(path)["x"]
    assert loaded.dtype == np.dtype(np.float64) and loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, [1.0, -2.5, 1e30])


def test_any_object_with_array_interface_is_accepted(tmp_path):
    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.arange(6, dtype=np.int32).reshape(2, 3)

    path = tmp_path / "weights.safetensors"
    save_weights(path, {"w": ArrayLike()})
    assert_same_array(load_weights(path)["w"], np.arange(6, dtype=np.int32).reshape(2, 3))


def test_loaded_arrays_are_independent_copies(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"w": np.zeros(4, np.float32)})
    first = load_weights(path)["w"]
    first[:] = 7
    assert not load_weights(path)["w"].any()


# The byte layout, checked by hand


@needs_little_endian_host
def test_written_file_follows_the_format_byte_for_byte(tmp_path):
    tensors = {
        "z.bias": random_array(np.float16, (3,), seed=1),
        "a.weight": random_array(ml_dtypes.bfloat16, (2, 5), seed=2),
        "m.mask": random_array(np.bool_, (3,), seed=3),
        "b.index": random_array(np.int64, (2, 2), seed=4),
    }
    metadata = {"format": "np"}
    path = tmp_path / "weights.safetensors"
    save_weights(path, tensors, metadata=metadata)

    header_length, header_bytes, data = parse_by_hand(path)
    assert (8 + header_length) % 8 == 0, "the data buffer must start 8-byte aligned"
    assert header_bytes.startswith(b"{")
    stripped = header_bytes.rstrip(b" ")
    assert len(header_bytes) - len(stripped) < 8, "padding is only what alignment needs"
    header = json.loads(header_bytes.decode("utf-8"))
    assert header.pop("__metadata__") == metadata
    assert set(header) == set(tensors)

    position = 0
    for name in sorted(tensors):  # written sorted by name, back to back
        entry = header[name]
        array = tensors[name]
        assert entry["shape"] == list(array.shape)
        assert SUPPORTED_DTYPES[entry["dtype"]] == array.dtype
        assert entry["data_offsets"] == [position, position + array.nbytes]
        assert data[position : position + array.nbytes] == array.tobytes()
        position += array.nbytes
    assert position == len(data)


def test_hand_built_file_is_read_as_written(tmp_path):
    # Stored out of name order, with whitespace around an unaligned header: all allowed to other writers.
    weight = np.arange(12, dtype="<f4").reshape(3, 4) / 8
    bf16_bits = np.array([0x3F80, 0xC000, 0x7FC1], dtype="<u2")  # 1.0, -2.0 and a NaN with a payload
    header = {
        "weight": {"dtype": "F32", "shape": [3, 4], "data_offsets": [6, 54], "comment": "other keys are ignored"},
        "half": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "empty": {"dtype": "I32", "shape": [2, 0], "data_offsets": [54, 54]},
        "scalar": {"dtype": "I16", "shape": [], "data_offsets": [54, 56]},
        "flags": {"dtype": "BOOL", "shape": [2], "data_offsets": [56, 58]},
        "__metadata__": {"source": "by hand"},
    }
    data = bf16_bits.tobytes() + weight.tobytes() + struct.pack("<h", -300) + b"\x01\x00"
    path = tmp_path / "hand.safetensors"
    write_by_hand(path, b"\n " + json.dumps(header).encode("utf-8"), data, padding=b"   ")

    loaded = load_weights(path)
    assert list(loaded) == ["empty", "flags", "half", "scalar", "weight"]
    assert_same_array(loaded["weight"], weight.astype(np.float32))
    assert loaded["half"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bit_pattern(loaded["half"]), bf16_bits)
    np.testing.assert_array_equal(loaded["half"][:2].astype(np.float32), [1.0, -2.0])
    assert_same_array(loaded["empty"], np.zeros((2, 0), np.int32))
    assert_same_array(loaded["scalar"], np.array(-300, np.int16))
    assert_same_array(loaded["flags"], np.array([True, False]))
    assert load_metadata(path) == {"source": "by hand"}


# Corrupt files

VALID_HEADER = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I8", "shape": [3], "data_offsets": [8, 11]},
}
VALID_DATA = struct.pack("<2f", 1.5, -3.0) + bytes([1, 2, 3])


def changed(name=None, data=VALID_DATA, **fields):
    """VALID_HEADER with fields of tensor `name` replaced (None deletes one), and a data buffer."""
    header = copy.deepcopy(VALID_HEADER)
    for key, value in fields.items():
        if value is None:
            del header[name][key]
        else:
            header[name][key] = value
    return header, data


def test_the_valid_file_behind_the_corruption_cases_loads(tmp_path):
    path = tmp_path / "valid.safetensors"
    write_by_hand(path, *changed())
    loaded = load_weights(path)
    np.testing.assert_array_equal(loaded["a"], np.array([1.5, -3.0], np.float32))
    np.testing.assert_array_equal(loaded["b"], np.array([1, 2, 3], np.int8))


CORRUPT_HEADERS = {
    "unknown dtype": (*changed("a", dtype="C64"), "has dtype 'C64'"),
    "float8 is not supported": (*changed("a", dtype="F8_E4M3"), "has dtype 'F8_E4M3'"),
    "lower-case dtype": (*changed("a", dtype="f32"), "has dtype 'f32'"),
    "dtype not a string": (*changed("a", dtype=4), "has dtype 4"),
    "missing dtype": (*changed("a", dtype=None), "must be an object with the keys"),
    "missing shape": (*changed("a", shape=None), "must be an object with the keys"),
    "missing data_offsets": (*changed("a", data_offsets=None), "must be an object with the keys"),
    "entry not an object": ({**VALID_HEADER, "a": [0, 8]}, VALID_DATA, "must be an object with the keys"),
    "negative dimension": (*changed("a", shape=[-2]), "has shape"),
    "boolean dimension": (*changed("a", shape=[True, 2]), "has shape"),
    "float dimension": (*changed("a", shape=[2.0]), "has shape"),
    "shape not a list": (*changed("a", shape=2), "has shape"),
    "one offset": (*changed("a", data_offsets=[0]), "has data_offsets"),
    "three offsets": (*changed("a", data_offsets=[0, 8, 8]), "has data_offsets"),
    "negative offset": (*changed("a", data_offsets=[-1, 8]), "has data_offsets"),
    "string offsets": (*changed("a", data_offsets=["0", "8"]), "has data_offsets"),
    "offsets not a list": (*changed("a", data_offsets={"begin": 0}), "has data_offsets"),
    "length does not match shape": (*changed("a", shape=[3]), "spans 8 bytes"),
    "length does not match dtype": (*changed("a", dtype="F64"), "spans 8 bytes"),
    "end past the data": (*changed("b", shape=[4], data_offsets=[8, 12]), "outside the data buffer"),
    "begin after end": (*changed("b", data_offsets=[11, 8]), "outside the data buffer"),
    "overlapping tensors": (*changed("b", data_offsets=[6, 9], data=VALID_DATA[:9]), "overlaps"),
    "same bytes twice": (*changed("b", dtype="F32", shape=[2], data_offsets=[0, 8], data=VALID_DATA[:8]), "overlaps"),
    "hole between tensors": (*changed("b", data_offsets=[9, 12], data=VALID_DATA + b"\0"), "belong to no tensor"),
    "hole at the start": (
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}},
        b"\0" + VALID_DATA[:8],
        "bytes 0..1 of the data buffer belong to no tensor",
    ),
    "bytes after the last tensor": (*changed(data=VALID_DATA + b"\0\0"), "bytes 11..13 of the data buffer"),
    "metadata not an object": ({**VALID_HEADER, "__metadata__": ["x"]}, VALID_DATA, "object of strings"),
    "metadata value not a string": ({**VALID_HEADER, "__metadata__": {"k": 1}}, VALID_DATA, "object of strings"),
    "empty tensor too large for NumPy": (
        {"z": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}},
        b"",
        "too large",
    ),
}


@pytest.mark.parametrize("header, data, message", CORRUPT_HEADERS.values(), ids=CORRUPT_HEADERS)
def test_corrupt_header_entries_raise_value_error(tmp_path, header, data, message):
    path = tmp_path / "corrupt.safetensors"
    write_by_hand(path, header, data)
    for read in (load_weights, load_metadata):
        with pytest.raises(ValueError, match=message) as raised:
            read(path)
        assert str(path) in str(raised.value)


UNPARSABLE_HEADERS = {
    "invalid JSON": (b'{"a": {"dtype": ', "not valid UTF-8 JSON"),
    "invalid UTF-8": (b'{"\xff\xfe": {}}', "not valid UTF-8 JSON"),
    "trailing garbage": (b"{}}", "not valid UTF-8 JSON"),
    "nested too deep for the parser": (b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "not valid UTF-8 JSON"),
    "duplicate tensor name": (
        b'{"a": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]},'
        b' "a": {"dtype": "I8", "shape": [1], "data_offsets": [1, 2]}}',
        "duplicate keys",
    ),
    "a list, not an object": (b"[1, 2]", "not a JSON object"),
    "a string, not an object": (b'"{}"', "not a JSON object"),
    "empty header": (b"", "not valid UTF-8 JSON"),
}


def test_bool_bytes_other_than_zero_and_one_raise_value_error(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    write_by_hand(path, {"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\x01\x00\x02")
    with pytest.raises(ValueError, match="BOOL but holds bytes other than 0 and 1"):
        load_weights(path)


@pytest.mark.parametrize("header_bytes, message", UNPARSABLE_HEADERS.values(), ids=UNPARSABLE_HEADERS)
def test_unparsable_headers_raise_value_error(tmp_path, header_bytes, message):
    path = tmp_path / "corrupt.safetensors"
    write_by_hand(path, header_bytes, b"\0\0")
    with pytest.raises(ValueError, match=message) as raised:
        load_weights(path)
    assert str(path) in str(raised.value)


def test_file_shorter_than_the_length_field_raises_value_error(tmp_path):
    path = tmp_path / "short.safetensors"
    for content in (b"", b"\x02\0\0\0\0\0\0"):
        path.write_bytes(content)
        with pytest.raises(ValueError, match="too short") as raised:
            load_weights(path)
        assert str(path) in str(raised.value)


def test_header_length_past_the_end_of_the_file_raises_value_error(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(struct.pack("<Q", 3) + b"{}")
    with pytest.raises(ValueError, match="more than the file"):
        load_weights(path)


def test_unreasonably_large_header_length_raises_value_error(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    with pytest.raises(ValueError, match="exceeds the limit"):
        load_metadata(path)
    # Over the limit but inside the file, so only the limit can reject it (sparse file: no real disk use).
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", weights_file.MAX_HEADER_BYTES + 1) + b"{")
        handle.truncate(8 + weights_file.MAX_HEADER_BYTES + 16)
    with pytest.raises(ValueError, match="exceeds the limit"):
        load_metadata(path)


def test_every_truncation_of_a_valid_file_raises_value_error(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int64)}, metadata={"k": "v"})
    content = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    for length in range(len(content)):
        truncated.write_bytes(content[:length])
        with pytest.raises(ValueError, match="truncated.safetensors"):
            load_weights(truncated)


def test_missing_file_raises_file_not_found(tmp_path):
    for read in (load_weights, load_metadata):
        with pytest.raises(FileNotFoundError):
            read(tmp_path / "absent.safetensors")


# What cannot be saved


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(3, np.complex64),
        np.array(["a", "bc"]),
        np.array([b"a"]),
        np.array([{}, []], dtype=object),
        np.zeros(2, np.uint16),
        np.zeros(2, ml_dtypes.float8_e4m3fn),
        np.zeros(2, [("x", np.float32), ("y", np.int8)]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
    ],
    ids=lambda array: str(array.dtype),
)
def test_unsupported_dtype_raises_type_error_naming_tensor_and_dtype(tmp_path, array):
    path = tmp_path / "weights.safetensors"
    with pytest.raises(TypeError, match="'bad'") as raised:
        save_weights(path, {"good": np.zeros(2, np.float32), "bad": array})
    assert str(array.dtype) in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_non_string_names_and_metadata_raise_type_error(tmp_path):
    path = tmp_path / "weights.safetensors"
    with pytest.raises(TypeError, match="names must be str"):
        save_weights(path, {1: np.zeros(2, np.float32)})
    with pytest.raises(TypeError, match="metadata"):
        save_weights(path, {"w": np.zeros(2, np.float32)}, metadata={"epoch": 3})
    with pytest.raises(TypeError, match="metadata"):
        save_weights(path, {"w": np.zeros(2, np.float32)}, metadata={3: "epoch"})
    assert list(tmp_path.iterdir()) == []


def test_reserved_metadata_name_cannot_name_a_tensor(tmp_path):
    with pytest.raises(ValueError, match="__metadata__"):
        save_weights(tmp_path / "weights.safetensors", {"__metadata__": np.zeros(2, np.float32)})
    assert list(tmp_path.iterdir()) == []


# Atomic writes


def test_write_failing_midway_leaves_neither_file_nor_temporary(tmp_path, monkeypatch):
    real_bytes = weights_file._little_endian_bytes
    calls = []

    def fail_on_second_tensor(array):
        calls.append(array)
        if len(calls) == 2:
            partial = list(tmp_path.iterdir())
            assert len(partial) == 1 and partial[0].stat().st_size > 8, "a partial temporary file should exist now"
            raise OSError("disk full")
        return real_bytes(array)

    monkeypatch.setattr(weights_file, "_little_endian_bytes", fail_on_second_tensor)
    tensors = {"a": np.ones(100_000, np.float32), "b": np.ones(100_000, np.float32)}  # past write buffering
    with pytest.raises(OSError, match="disk full"):
        save_weights(tmp_path / "weights.safetensors", tensors)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", [OSError("rename failed"), KeyboardInterrupt()], ids=["OSError", "interrupt"])
def test_failed_replace_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch, failure):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"old": np.arange(3, dtype=np.int32)})
    old_content = path.read_bytes()

    def failing_replace(source, destination):
        assert pathlib.Path(source).parent == tmp_path and pathlib.Path(source).stat().st_size > len(old_content)
        raise failure

    monkeypatch.setattr(weights_file.os, "replace", failing_replace)
    with pytest.raises(type(failure)):
        save_weights(path, {"new": np.arange(100, dtype=np.int64)})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == old_content


def test_saving_over_an_existing_file_replaces_it_whole(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"big": np.ones(1000, np.float64)}, metadata={"version": "1"})
    save_weights(path, {"small": np.zeros(2, np.int8)})
    assert list(tmp_path.iterdir()) == [path]
    loaded = load_weights(path)
    assert list(loaded) == ["small"]
    assert_same_array(loaded["small"], np.zeros(2, np.int8))
    assert load_metadata(path) == {}


def test_new_file_permissions_follow_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        save_weights(tmp_path / "weights.safetensors", {"w": np.zeros(1, np.float32)})
    finally:
        os.umask(previous)
    assert (tmp_path / "weights.safetensors").stat().st_mode & 0o777 == 0o640


# The reference implementation, when installed


def test_files_are_interchangeable_with_the_safetensors_package(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    tensors = {
        f"t.{code}": random_array(dtype, (2, 3) if index % 2 else (5,), seed=index)
        for index, (code, dtype) in enumerate(SUPPORTED_DTYPES.items())
        if code != "BF16"  # older safetensors.numpy has no bfloat16; the hand-built file checks its bytes
    }
    tensors["scalar"] = np.array(4.5, np.float32)
    tensors["empty"] = np.zeros((0, 3), np.int32)
    metadata = {"format": "np", "author": "test"}

    ours = tmp_path / "ours.safetensors"
    save_weights(ours, tensors, metadata=metadata)
    read_by_reference = safetensors_numpy.load_file(str(ours))
    assert set(read_by_reference) == set(tensors)
    for name, original in tensors.items():
        assert_same_array(read_by_reference[name], original)
    with safe_open(str(ours), framework="np") as reference_file:
        assert reference_file.metadata() == metadata

    theirs = tmp_path / "theirs.safetensors"
    safetensors_numpy.save_file(tensors, str(theirs), metadata=metadata)
    read_by_us = load_weights(theirs)
    assert set(read_by_us) == set(tensors)
    for name, original in tensors.items():
        assert_same_array(read_by_us[name], original)
    assert load_metadata(theirs) == metadata
