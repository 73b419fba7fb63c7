"""Out-of-memory errors: recognising them whichever allocator raised them, and naming the sizes of
the convolution, or of the kernel map, that ran out in them.

A convolution or a kernel map that does not fit raises the error of the allocator that failed, of
its own type: `cupy.cuda.memory.OutOfMemoryError` from CuPy's pool, `torch.OutOfMemoryError` when
the torch adapter routes CuPy's allocations to torch's caching allocator, `MemoryError` from NumPy.
The message keeps the allocator's words (the bytes requested, what is in use) and gains the sizes,
added by `naming_sizes` around the library's convolution entry points and `naming_map_sizes` around
a kernel map's build, once per error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# What CUDA libraries say when their own allocation fails (cuBLAS, cuSPARSE: *_STATUS_ALLOC_FAILED).
_LIBRARY_ALLOCATION_FAILURE = "ALLOC_FAILED"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says an allocation failed: NumPy's and CuPy's `MemoryError`s, torch's
    `OutOfMemoryError`, a CUDA runtime or library error reporting out of memory."""
    if isinstance(error, MemoryError) or any(cls.__name__ == "OutOfMemoryError" for cls in type(error).__mro__):
        return True
    text = str(error)
    return "out of memory" in text.lower() or _LIBRARY_ALLOCATION_FAILURE in text


@dataclass(frozen=True)
class ConvSizes:
    """The sizes of one convolution call, as an out-of-memory message names them."""

    phase: str  # "forward" or "backward"
    num_in: int
    num_out: int
    in_channels: int
    out_channels: int
    kernel_volume: int
    dtype_name: str  # "float16", …: NumPy's names, which torch's share after their "torch." prefix
    itemsize: int
    depthwise: bool = False

    @classmethod
    def of(cls, phase: str, features, weight, kernel_map, depthwise: bool = False) -> ConvSizes:
        """The sizes of `features` (`[N_in, C_in]`) convolved with `weight` over `kernel_map`; the
        arrays may be the core's or a framework's."""
        out_channels = weight.shape[1] if depthwise else weight.shape[2]
        return cls(phase, kernel_map.num_in, kernel_map.num_out, int(features.shape[1]), int(out_channels),
                   kernel_map.kernel_volume, str(features.dtype).removeprefix("torch."), features.dtype.itemsize,
                   depthwise)

    def describe(self, algorithm: str | None) -> str:
        rows_in, rows_out = ("input", "output") if self.phase == "forward" else (
            "input (and its gradient)", "output gradient")
        weight = (self.kernel_volume, self.in_channels) if self.depthwise else (
            self.kernel_volume, self.in_channels, self.out_channels)
        operands = (
            f"{rows_in} {self.num_in:,} rows x {self.in_channels} channels "
            f"({_bytes(self.num_in * self.in_channels * self.itemsize)})",
            f"{rows_out} {self.num_out:,} rows x {self.out_channels} channels "
            f"({_bytes(self.num_out * self.out_channels * self.itemsize)})",
            f"weight {' x '.join(str(n) for n in weight)} ({_bytes(int(np.prod(weight)) * self.itemsize)})",
        )
        kind = "depthwise convolution" if self.depthwise else "convolution"
        running = f" running {algorithm}" if algorithm else ""
        return (
            f"cupysparse ran out of memory in the {self.phase} of a {kind}{running}: {', '.join(operands)}, "
            f"{self.dtype_name}"
        )


@dataclass(frozen=True)
class MapSizes:
    """The sizes of one kernel map's build, as an out-of-memory message names them."""

    num_coordinates: int  # the input's
    tensor_stride: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    generative: bool
    padding: tuple[int, ...] | None = None  # spconv's geometry (`geometry.padding`); None: unpadded

    def describe(self) -> str:
        offsets = int(np.prod(self.kernel_size))
        kind = ("generative transposed" if self.generative else "transposed" if self.transposed
                else "padded" if self.padding is not None
                else "strided" if any(s > 1 for s in self.stride) else "submanifold")
        padding = "" if self.padding is None else f", padding {self.padding}"
        return (
            f"cupysparse ran out of memory building the kernel map of a {kind} convolution: "
            f"{self.num_coordinates:,} coordinates at tensor stride {self.tensor_stride}, kernel {self.kernel_size} "
            f"({offsets} offsets), stride {self.stride}, dilation {self.dilation}{padding}; its pair table takes 4 "
            f"bytes per "
            f"output row and offset ({_bytes(4 * offsets * self.num_coordinates)} for "
            f"{self.num_coordinates:,} output rows)"
        )


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} bytes"


_NAMED_ATTRIBUTE = "_cupysparse_sizes_named"


def name_sizes(error: BaseException, description: str) -> None:
    """Add `description` to `error`'s message, in place (its type and traceback stay): in its
    arguments where its text comes from them, else as a note the traceback prints. Only the first
    description given an error is added (the innermost call's)."""
    if getattr(error, _NAMED_ATTRIBUTE, False):
        return
    setattr(error, _NAMED_ATTRIBUTE, True)
    original, before = error.args, str(error)
    if not original:
        error.args = (description,)
    elif isinstance(original[0], str):
        error.args = (f"{original[0]} ({description})", *original[1:])
    if description not in str(error) or before not in str(error):
        # The class makes its text itself (NumPy's array allocation error): keep it, add a note.
        error.args = original
        error.add_note(description)


class _NamingOnOutOfMemory:
    """A context manager whose out-of-memory errors gain `description()`, worked out only then (the
    hot path pays nothing); other errors pass untouched."""

    __slots__ = ()

    def description(self) -> str:
        raise NotImplementedError

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        self.name(error)
        return False

    def name(self, error: BaseException | None) -> None:
        """Name the sizes in `error` if it is out of memory: the `with` statement's work, for a caller
        that catches the error itself."""
        if isinstance(error, Exception) and is_out_of_memory(error):
            name_sizes(error, self.description())


class naming_sizes(_NamingOnOutOfMemory):  # lower case: used as a context manager, like contextlib's
    """`with naming_sizes(phase, features, weight, kernel_map, algorithm):` an out-of-memory error
    raised inside names the convolution's sizes (`ConvSizes.of` the arguments)."""

    __slots__ = ("_arguments", "_algorithm")

    def __init__(self, phase: str, features, weight, kernel_map, algorithm: str | None = None,
                 depthwise: bool = False):
        self._arguments = (phase, features, weight, kernel_map, depthwise)
        self._algorithm = algorithm

    def description(self) -> str:
        return ConvSizes.of(*self._arguments).describe(self._algorithm)


class naming_map_sizes(_NamingOnOutOfMemory):
    """`with naming_map_sizes(MapSizes(...)):` an out-of-memory error raised inside names the kernel
    map's sizes."""

    __slots__ = ("_sizes",)

    def __init__(self, sizes: MapSizes):
        self._sizes = sizes

    def description(self) -> str:
        return self._sizes.describe()
