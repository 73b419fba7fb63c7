"""What every convolution algorithm is: a registered object with a parameter space, a `supports`
predicate and forward / dgrad / wgrad entry points over a `KernelMap`.

The registry is the only list of algorithms. Two kinds exist: `"conv"` (weights `[K, C_in, C_out]`)
and `"depthwise"` (weights `[K, C]`). Every entry point takes and returns NumPy arrays on the CPU
and CuPy arrays on the GPU, in the dtype of its inputs; accumulation is at least fp32.

Phases, for a map whose pair table `[K, N_out]` holds the input row feeding output row i
through offset k (or -1):
- forward: `out[i] = Σ_k W_k^T · x[table[k, i]]`                 → `[N_out, C_out]`
- dgrad:   `dx[j]  = Σ_k W_k · dy[i]` over pairs (k, j, i)        → `[N_in, C_in]`
- wgrad:   `dW_k   = Σ_i x[table[k, i]]^T · dy[i]` (outer product) → `[K, C_in, C_out]`
forward and dgrad receive the weight as returned by `prepare_weight`; wgrad returns a plain array.
Depthwise replaces the matrix products by per-channel ones (`W_k` is a vector `[C]`).

An algorithm may also offer launch plans (`forward_plan`, `backward_plan`): the same phases for one
layer signature (kernel volume, channel counts, dtype, device, parameters), prepared once and launched
over any kernel map of that signature on device addresses and a raw CUDA stream handle. Framework
adapters call them with buffers their framework allocated, at a cost of a few launches per call; a new
kernel map (a new scene) costs no new plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cupysparse.cuda.backend import cupy_module, is_cupy_array
from cupysparse.cuda.precision import uses_tf32

CONV = "conv"
DEPTHWISE = "depthwise"
KINDS = (CONV, DEPTHWISE)


@dataclass(frozen=True)
class ConvProblem:
    """What an algorithm needs to know to say whether it can run a convolution.

    `compute_capability` is e.g. 90 for sm_90, None on the CPU. For depthwise problems
    `in_channels == out_channels`. `tf32`: fp32 features on a GPU whose products may be rounded to
    TF32 (`cupysparse.cuda.precision`).
    """

    num_in: int
    num_out: int
    in_channels: int
    out_channels: int
    kernel_volume: int
    dtype: np.dtype
    device: str
    compute_capability: int | None
    stride: tuple[int, ...] = ()
    transposed: bool = False
    generative: bool = False
    tf32: bool = False

    @classmethod
    def of(cls, features, kernel_map, out_channels: int) -> ConvProblem:
        """The problem of applying a convolution with `out_channels` outputs over `kernel_map` to `features`."""
        return cls.over(kernel_map, int(features.shape[1]), out_channels, features.dtype, is_cupy_array(features))

    @classmethod
    def over(cls, kernel_map, in_channels: int, out_channels: int, dtype, on_gpu: bool) -> ConvProblem:
        """The problem of a convolution over `kernel_map` of `in_channels` features of `dtype` into
        `out_channels`, on the current GPU or the CPU: what `of` says without the arrays."""
        return cls(
            num_in=kernel_map.num_in,
            num_out=kernel_map.num_out,
            in_channels=int(in_channels),
            out_channels=int(out_channels),
            kernel_volume=kernel_map.kernel_volume,
            dtype=np.dtype(dtype),
            device="cuda" if on_gpu else "cpu",
            compute_capability=int(cupy_module().cuda.Device().compute_capability) if on_gpu else None,
            stride=tuple(kernel_map.stride),
            transposed=kernel_map.transposed,
            generative=kernel_map.generative,
            tf32=uses_tf32(dtype, on_gpu),
        )


@dataclass(frozen=True)
class ForwardPlan:
    """The forward of one layer signature on device addresses, over any kernel map of it (the
    problem's kernel volume, channel counts, dtype and device): `launch(kernel_map, features, weight,
    out, stream)` with features `[kernel_map.num_in, C_in]` and out `[kernel_map.num_out, C_out]`,
    row-major, and the weight in `weight_shape`: `[K, C_in, C_out]` zero-padded at the end of both
    channel dimensions, or with `weight_transposed` each offset's matrix transposed, `[K, C_out, C_in]`
    padded likewise (a kernel that must read it K-major); `stream` is a raw CUDA stream handle. The
    kernels are those of the device the plan was made on; the map's derived formats are computed on
    first use and kept with the map. With `fuses_epilogue`, `launch` also takes `epilogue=` (scale,
    shift, residual, relu: `functional.epilogue.ConvEpilogue`'s addresses) and applies it as it stores.
    With `staging_shape`, `launch` also takes `staging=`: the address of fp32 memory of
    `staging_shape(kernel_map)` (16-byte aligned, no initialisation needed) that it copies operands into."""

    weight_shape: tuple[int, int, int]
    launch: Callable[..., None]
    weight_transposed: bool = False
    fuses_epilogue: bool = False
    staging_shape: Callable[..., tuple[int, ...]] | None = None


@dataclass(frozen=True)
class BackwardPlan:
    """dgrad and wgrad of one layer signature on device addresses, as `ForwardPlan`:
    `launch(kernel_map, grad_output, features, weight, grad_input, workspace, grad_weight, stream)` with
    the weight in `weight_shape` (as the forward's: `[K, C_in, C_out]` zero-padded at the end of both
    channel dimensions) and an fp32 workspace of `workspace_shape(kernel_map)` (no initialisation
    needed); a gradient whose address is 0 is not computed (nor are its operands read: `weight` for
    dgrad, `features` and `workspace` for wgrad). Arrays row-major, in the features' dtype.
    `wgrad_shares(kernel_map)`, where given, is the `(rounds, round_major)` of the wgrad shares its launch
    derives from a map (`KernelMap.wgrad_shares`), so that a network's can be derived together beforehand.
    `staging_shape` as `ForwardPlan`'s, for either gradient."""

    weight_shape: tuple[int, int, int]
    workspace_shape: Callable[..., tuple[int, ...]]
    launch: Callable[..., None]
    wgrad_shares: Callable[..., tuple[int, bool]] | None = None
    staging_shape: Callable[..., tuple[int, ...]] | None = None


class Algorithm:
    """Base of every algorithm. Subclasses set the class attributes and the three phases.

    `forward_params` / `backward_params` map each tunable parameter to its candidate values; the
    first value of each is the default. `backward_params` apply to dgrad and wgrad alike.
    """

    name: ClassVar[str]
    kind: ClassVar[str] = CONV
    forward_params: ClassVar[dict[str, tuple]] = {}
    backward_params: ClassVar[dict[str, tuple]] = {}
    # The raw_kernels files it launches: a cached measurement goes stale when one of them changes.
    kernel_sources: ClassVar[tuple[str, ...]] = ()
    # The benchmark-cache namespace of its own parameter sweep, per phase ("forward", "backward").
    tuning_namespaces: ClassVar[dict[str, str]]
    # Whether CUDA-graph capture can record its GPU work (the tuner substitutes one that can).
    capturable: ClassVar[bool] = True
    # Whether it is its kind's reference (`reference_algorithm`): it runs every problem of its kind, on
    # every device and dtype, and the others are checked against it. One per kind.
    reference: ClassVar[bool] = False

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        """Why this algorithm cannot run `problem`, or None when it can."""
        return None

    def supports(self, problem: ConvProblem) -> bool:
        return self.unsupported_reason(problem) is None

    def auto_priority(self, problem: ConvProblem) -> int:
        """Until the tuner measures, `auto` runs the supported algorithm with the highest priority."""
        return 0

    def kernel_modules(self, phase: str, problem: ConvProblem, params: dict) -> tuple:
        """The `KernelSource`s (modules) a run of `phase` ("forward", or "backward": dgrad and wgrad)
        with `params` on `problem` launches from, within the files of `kernel_sources`: the tuner has
        a set of candidates' modules compiled side by side before it measures them. A module left out
        is compiled at its first launch. Default: none (no raw kernels)."""
        return ()

    def prepare_weight(self, weight):
        """The weight in the form forward and dgrad take (e.g. padded); called once per call, not
        per launch, and reusable for as long as the weight does not change. Default: as is."""
        return weight

    def forward(self, features, weight, kernel_map, **params):
        raise NotImplementedError

    def dgrad(self, grad_output, weight, kernel_map, **params):
        raise NotImplementedError

    def wgrad(self, features, grad_output, kernel_map, **params):
        raise NotImplementedError

    def forward_plan(self, problem: ConvProblem, params: dict) -> ForwardPlan | None:
        """The forward's launch plan with `params` for every map of `problem`'s signature (its sizes
        are not used), or None (default): this algorithm runs through `forward` only."""
        return None

    def backward_plan(self, problem: ConvProblem, params: dict) -> BackwardPlan | None:
        """dgrad's and wgrad's launch plan, or None (default): only through `dgrad` and `wgrad`."""
        return None

    def transient_bytes(self, problem: ConvProblem, phase: str, params: dict, max_offset_pairs: int) -> int:
        """An estimate of the memory one call of `phase` ("forward", "dgrad", "wgrad" or "backward": both
        gradients) with `params` allocates on `problem` and frees before it returns: what it needs beyond
        its inputs and outputs. `max_offset_pairs`: the pairs of the map's busiest offset. Default: 0."""
        return 0

    def tuning_namespace(self, phase: str) -> str:
        return self.tuning_namespaces[phase]

    def default_params(self, phase: str) -> dict:
        """The default parameters of `phase` ("forward" or "backward")."""
        space = self.forward_params if phase == "forward" else self.backward_params
        return {name: values[0] for name, values in space.items()}

    def auto_param_grid(self, phase: str, problem: ConvProblem) -> list[dict]:
        """The parameter combinations `auto` tries for `problem`: a reduced grid where measurements
        showed the rest never win. Default: the whole grid."""
        return self.param_grid(phase)

    def param_grid(self, phase: str) -> list[dict]:
        """Every parameter combination of `phase`, the default first."""
        space = self.forward_params if phase == "forward" else self.backward_params
        names = list(space)
        return [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]

    def __repr__(self) -> str:
        return f"<{self.kind} algorithm {self.name!r}>"


_REGISTRY: dict[str, dict[str, Algorithm]] = {kind: {} for kind in KINDS}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: instantiate the algorithm and add it to the registry of its kind."""
    if cls.kind not in _REGISTRY:
        raise ValueError(f"unknown algorithm kind {cls.kind!r}; kinds are {KINDS}")
    if cls.name in _REGISTRY[cls.kind]:
        raise ValueError(f"a {cls.kind} algorithm named {cls.name!r} is already registered")
    if cls.reference and any(algorithm.reference for algorithm in _REGISTRY[cls.kind].values()):
        raise ValueError(f"{cls.name!r} cannot be the {cls.kind} reference: "
                         f"{reference_algorithm(cls.kind).name!r} is")
    _REGISTRY[cls.kind][cls.name] = cls()
    return cls


def registered(kind: str = CONV) -> dict[str, Algorithm]:
    """The algorithms of `kind`, by name, in registration order."""
    return dict(_REGISTRY[kind])


def get_algorithm(name: str, kind: str = CONV) -> Algorithm:
    """The algorithm `name` of `kind`; ValueError listing the valid names otherwise."""
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        valid = ", ".join(_REGISTRY[kind]) or "(none)"
        raise ValueError(f"{name!r} is not a {kind} algorithm; valid names: {valid}") from None


def reference_algorithm(kind: str = CONV) -> Algorithm:
    """The reference algorithm of `kind` (the one with `reference` set): it runs every problem, and the
    others are checked against it."""
    for algorithm in _REGISTRY[kind].values():
        if algorithm.reference:
            return algorithm
    raise ValueError(f"no {kind} algorithm is registered as the reference")


# The raw kernels' weight gradients launch one grid z slice per kernel offset (times a split), and
# gridDim.z is at most 65535.
MAX_GRID_Z = 65535


def gpu_only_reason(problem: ConvProblem) -> str | None:
    """Why the raw-kernel algorithms (GPU only, offsets on grid z) cannot run `problem`, or None."""
    if problem.device != "cuda":
        return "runs on CUDA GPUs only (the input is a NumPy array)"
    if problem.kernel_volume > MAX_GRID_Z:
        return (f"its kernels take at most {MAX_GRID_Z} kernel offsets (one CUDA grid slice each), "
                f"not {problem.kernel_volume}")
    return None
