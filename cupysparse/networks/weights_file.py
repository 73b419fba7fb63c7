"""Network weights in the safetensors file format, read and written with NumPy alone.

safetensors holds named arrays and nothing else: loading one runs no code (unlike pickle), it
carries bfloat16, and PyTorch users can write it with the `safetensors` package
(`safetensors.torch.save_file`) for us to read, or read ours.

Layout: an 8-byte little-endian unsigned header length N; N bytes of UTF-8 JSON mapping each
tensor name to {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, the offsets
relative to the data buffer that follows the header, plus an optional "__metadata__" object of
strings; the header is padded with spaces so that the data starts 8-byte aligned. The data buffer
is the tensors' raw little-endian C-order bytes, every byte belonging to exactly one tensor.

The reader trusts nothing in the file: every field is checked before it is used, and a file that
breaks the format raises ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
from collections.abc import Mapping

import numpy as np

from cupysparse.cuda.backend import to_numpy
from cupysparse.cuda.dtypes import BFLOAT16

# The safetensors dtype names we support, and the native NumPy dtypes they stand for.
_DTYPES_BY_CODE = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
if BFLOAT16 is not None:
    _DTYPES_BY_CODE["BF16"] = BFLOAT16
# Keyed by name, which ignores byte order: a big-endian float32 array is still F32.
_CODES_BY_DTYPE_NAME = {dtype.name: code for code, dtype in _DTYPES_BY_CODE.items()}

_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_HEADER_LENGTH = struct.Struct("<Q")
_DATA_ALIGNMENT = 8
# The reference implementation's limit too; real headers are a few MB at most.
MAX_HEADER_BYTES = 100_000_000

_Entry = tuple[np.dtype, tuple[int, ...], tuple[int, int]]  # dtype, shape, (begin, end) in the data buffer


def save_weights(
    path: str | os.PathLike, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (name → NumPy/CuPy array) and optional string `metadata` to a safetensors file.

    The file appears at `path` complete or not at all: it is written to a temporary file beside
    it, then renamed over it.
    """
    path = os.fspath(path)
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
    if _METADATA_KEY in tensors:
        raise ValueError(f"{_METADATA_KEY!r} is reserved for the metadata and cannot name a tensor")
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata keys and values must be str, got {key!r}: {value!r}")
    header: dict[str, object] = {_METADATA_KEY: dict(metadata)} if metadata else {}
    arrays = {name: _prepared_array(name, tensors[name]) for name in sorted(tensors)}
    offset = 0
    for name, array in arrays.items():
        header[name] = {
            "dtype": _CODES_BY_DTYPE_NAME[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    header_bytes = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(_HEADER_LENGTH.size + len(header_bytes)) % _DATA_ALIGNMENT)

    directory, file_name = os.path.split(path)
    temporary = os.path.join(directory, f".{file_name}.{secrets.token_hex(8)}.tmp")
    # 0o666 lets the umask decide the permissions, as for any newly created file.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(_HEADER_LENGTH.pack(len(header_bytes)))
            handle.write(header_bytes)
            for array in arrays.values():
                handle.write(_little_endian_bytes(array))
            handle.flush()
            os.fsync(handle.fileno())  # the data must be on disk before the rename makes it visible
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def load_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, by name in sorted order, as writable native-order NumPy arrays."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        entries, _ = _read_header(path, handle)
        data_start = handle.tell()
        tensors = {}
        for name in sorted(entries):
            dtype, shape, (begin, end) = entries[name]
            handle.seek(data_start + begin)
            raw = handle.read(end - begin)
            if len(raw) != end - begin:  # the file shrank since its size was checked
                raise ValueError(f"{path}: the file ended inside tensor {name!r}")
            array = _array_from_little_endian(raw, dtype, shape)
            # A bool byte is 0 or 1; anything else means the data is not what the header says it is.
            if dtype == np.bool_ and np.any(array.view(np.uint8) > 1):
                raise ValueError(f"{path}: tensor {name!r} is BOOL but holds bytes other than 0 and 1")
            tensors[name] = array
    return tensors


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The "__metadata__" strings of a safetensors file ({} when it has none); reads only its header."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        _, metadata = _read_header(path, handle)
    return metadata


def _prepared_array(name: str, tensor) -> np.ndarray:
    """`tensor` as a C-contiguous NumPy array in native byte order, if its dtype is one we can store."""
    array = to_numpy(tensor)
    code = _CODES_BY_DTYPE_NAME.get(array.dtype.name)
    if code is None:
        supported = ", ".join(dtype.name for dtype in _DTYPES_BY_CODE.values())
        raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which is not one of {supported}")
    return np.asarray(array, dtype=_DTYPES_BY_CODE[code], order="C")  # not ascontiguousarray: it makes 0-d 1-d


# Byte order is handled through unsigned integers of the same width: reordering their bytes works
# for every dtype, including ml_dtypes' bfloat16, which has no byte-swapped NumPy dtype.


def _little_endian_bytes(array: np.ndarray) -> bytes:
    width = array.dtype.itemsize
    return array.view(f"u{width}").astype(f"<u{width}", copy=False).tobytes()


def _array_from_little_endian(raw: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    width = dtype.itemsize
    native_integers = np.frombuffer(raw, dtype=f"<u{width}").astype(f"=u{width}")  # a writable copy
    return native_integers.view(dtype).reshape(shape)


def _read_header(path: str, handle) -> tuple[dict[str, _Entry], dict[str, str]]:
    """The checked tensor entries by name and the metadata, leaving `handle` at the start of the data buffer."""
    file_size = os.fstat(handle.fileno()).st_size
    if file_size < _HEADER_LENGTH.size:
        raise ValueError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (header_length,) = _HEADER_LENGTH.unpack(handle.read(_HEADER_LENGTH.size))
    if header_length > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {header_length} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if header_length > file_size - _HEADER_LENGTH.size:
        raise ValueError(f"{path}: header length {header_length} is more than the file's {file_size} bytes hold")
    header_bytes = handle.read(header_length)
    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_object_without_duplicate_keys)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: the header is not valid UTF-8 JSON: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")

    metadata = header.pop(_METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ValueError(f"{path}: {_METADATA_KEY} must be an object of strings")

    buffer_length = file_size - _HEADER_LENGTH.size - header_length
    entries = {name: _checked_entry(path, name, entry, buffer_length) for name, entry in header.items()}
    _check_tiling(path, entries, buffer_length)
    return entries, metadata


def _object_without_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):  # a repeated name would let two readers see different tensors
        raise ValueError(f"duplicate keys in {sorted(result)}")
    return result


def _is_count(value) -> bool:
    """A non-negative JSON integer (JSON's true and false arrive as Python bools, which are ints)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_entry(path: str, name: str, entry, buffer_length: int) -> _Entry:
    where = f"{path}: tensor {name!r}"
    # Other keys are ignored, as the reference implementation does.
    if not isinstance(entry, dict) or not _ENTRY_KEYS <= set(entry):
        raise ValueError(f"{where} must be an object with the keys {sorted(_ENTRY_KEYS)}, got {entry!r}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES_BY_CODE:
        raise ValueError(f"{where} has dtype {code!r}, which is not one of {', '.join(_DTYPES_BY_CODE)}")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise ValueError(f"{where} has shape {shape!r}, which is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(offset) for offset in offsets):
        raise ValueError(f"{where} has data_offsets {offsets!r}, which are not two non-negative integers")
    dtype = _DTYPES_BY_CODE[code]
    begin, end = offsets
    if not begin <= end <= buffer_length:
        raise ValueError(f"{where} has data_offsets {offsets} outside the data buffer of {buffer_length} bytes")
    expected_bytes = math.prod(shape) * dtype.itemsize
    if end - begin != expected_bytes:
        raise ValueError(f"{where} spans {end - begin} bytes, but {code} of shape {shape} takes {expected_bytes}")
    # Only reachable with a zero dimension (the data is no bigger than the file otherwise), but
    # NumPy refuses any shape whose nonzero dimensions multiply past its address space.
    if math.prod(max(dim, 1) for dim in shape) * dtype.itemsize > np.iinfo(np.intp).max:
        raise ValueError(f"{where} has shape {shape}, too large for NumPy even though it holds no elements")
    return dtype, tuple(shape), (begin, end)


def _check_tiling(path: str, entries: dict[str, _Entry], buffer_length: int) -> None:
    """The tensors must cover the data buffer exactly: no byte unused, none shared."""
    position = 0
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda item: item[1][2]):
        if begin < position:
            raise ValueError(f"{path}: tensor {name!r} at bytes {begin}..{end} overlaps the one before it")
        if begin > position:
            raise ValueError(f"{path}: bytes {position}..{begin} of the data buffer belong to no tensor")
        position = end
    if position != buffer_length:
        raise ValueError(f"{path}: bytes {position}..{buffer_length} of the data buffer belong to no tensor")
