"""The backends the memory analysis (`benchmark_memory_analysis`) measures on one layer: ours (an
algorithm by name, or `auto`, as a user calls them), spconv 2.x's layer and torch's dense convolution.
Each checks what it supports, prepares a phase's call, names what it dispatched, and estimates its
memory."""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np

from cupysparse.algorithms import CONV, get_algorithm
from cupysparse.cuda.dtypes import accumulation_dtype
from cupysparse.cuda.precision import TF32
from cupysparse.functional.convolution import conv_backward, conv_forward
from cupysparse.functional.execution import backward_runner, forward_runner
from cupysparse.networks.weight_layouts import to_torch_conv_weight
from cupysparse.scripts.benchmarking import spconv_layer, spconv_matches_geometry, torch_module
from cupysparse.scripts.memory_analysis_estimates import PHASE_INPUTS, LayerShape, MemoryEstimate, sparse_estimate
from cupysparse.scripts.memory_analysis_grid import Configuration, LayerArrays, MapCase
from cupysparse.tuning.search_space import AUTO, parse_algorithm_filter
from cupysparse.tuning.tuner import default_tuner

SPCONV = "spconv"
TORCH_DENSE = "torch"
# The tuner's choice a phase runs with: dgrad and wgrad are parts of the tuned backward.
TUNING_PHASES = {
    "forward": ("forward",), "dgrad": ("backward",), "wgrad": ("backward",), "backward": ("backward",),
    "both": ("forward", "backward"),
}


def describe_selection(selection) -> str:
    settings = ",".join(f"{key}={value}" for key, value in selection.params.items())
    return f"{selection.algorithm.name}({settings})"


class OursRunner:
    """One of our algorithms, or `auto`, on one layer, called as a user calls it: `conv_forward` /
    `conv_backward` with `algo=name` (the tuner's choice, measured on this data when not cached)."""

    memory_note = None

    def __init__(self, name: str, layer: LayerArrays, case: MapCase, shape: LayerShape):
        self.name, self.layer, self.case, self.shape = name, layer, case, shape
        self._selections = {}

    def unsupported_reason(self, phase: str) -> str | None:
        if self.name == AUTO:
            return None
        return get_algorithm(self.name).unsupported_reason(self.layer.problem)

    def _runner(self, tuning_phase: str):
        layer = self.layer
        if tuning_phase == "forward":
            return forward_runner(layer.features, layer.weight, layer.kernel_map)
        return backward_runner(layer.grad_output, layer.features, layer.weight, layer.kernel_map)

    def selection(self, tuning_phase: str):
        """The tuner's choice for the forward or the backward (dgrad and wgrad share it)."""
        if tuning_phase not in self._selections:
            run = self._runner(tuning_phase)
            search_space = parse_algorithm_filter(self.name, CONV, tuning_phase)
            chosen = default_tuner().select(search_space, self.layer.problem, run)
            if self.name != AUTO and chosen.algorithm.name != self.name:
                # The tuner fell back to the reference: run the algorithm itself so its failure (out
                # of memory, compile error) is what the row reports.
                algorithm = get_algorithm(self.name)
                run(algorithm, algorithm.default_params(tuning_phase))
                raise RuntimeError(f"the tuner rejected every {tuning_phase} parameter set of {self.name} "
                                   "(a disagreement with explicit_gemm; see its log)")
            self._selections[tuning_phase] = chosen
        return self._selections[tuning_phase]

    def _predicted(self, tuning_phase: str):
        """The choice before anything runs (the priority rule), for the memory check."""
        return self._selections.get(tuning_phase) or default_tuner().select(
            parse_algorithm_filter(self.name, CONV, tuning_phase), self.layer.problem)

    def prepare(self, phase: str):
        """The timed call: `conv_forward` / `conv_backward` themselves, as a user calls them (after the
        first call, a layer's kept launch plan), except dgrad and wgrad alone, which call the tuner's
        choice directly."""
        layer = self.layer
        if phase in ("forward", "both"):
            self.selection("forward")

            def forward_call():
                return conv_forward(layer.features, layer.weight, layer.kernel_map, self.name)

            if phase == "forward":
                return forward_call
        chosen = self.selection("backward")
        algorithm, params = chosen.algorithm, chosen.params
        if phase == "dgrad":
            return lambda: algorithm.dgrad(layer.grad_output, algorithm.prepare_weight(layer.weight),
                                           layer.kernel_map, **params)
        if phase == "wgrad":
            return lambda: algorithm.wgrad(layer.features, layer.grad_output, layer.kernel_map, **params)

        def backward_call():
            return conv_backward(layer.grad_output, layer.features, layer.weight, layer.kernel_map, self.name)

        if phase == "backward":
            return backward_call
        return lambda: (forward_call(), backward_call())

    def dispatched(self, phase: str) -> str:
        chosen = [(part, self._selections[part]) for part in TUNING_PHASES[phase] if part in self._selections]
        if phase != "both":
            return describe_selection(chosen[0][1]) if chosen else ""
        return "; ".join(f"{part}: {describe_selection(selection)}" for part, selection in chosen)

    def resident_bytes(self, phase: str) -> int:
        arrays = [getattr(self.layer, name) for name in PHASE_INPUTS[phase]] + [self.layer.weight]
        return sum(int(array.nbytes) for array in arrays) + self.case.nbytes

    def estimate(self, phase: str) -> MemoryEstimate:
        workspace = 0
        for tuning_phase in TUNING_PHASES[phase]:
            chosen = self._predicted(tuning_phase)
            part = tuning_phase if phase == "both" else phase
            workspace = max(workspace, chosen.algorithm.transient_bytes(self.layer.problem, part, chosen.params,
                                                                        self.case.max_offset_pairs))
        weights = self.shape.bytes_of("weight")
        return sparse_estimate(self.shape, phase, weights, self.case.nbytes, workspace)


@functools.cache
def spconv_import_error() -> str | None:
    """Why spconv 2.x cannot be imported, or None."""
    try:
        importlib.import_module("spconv.pytorch")
    except Exception as error:  # absent or broken (a wheel for another CUDA): the backend is not_supported
        return f"spconv is not importable ({type(error).__name__}: {error})"
    return None


class SpconvRunner:
    """spconv 2.x's layer (see `benchmarking.SpconvLayer`); its backward computes both gradients at
    once, so dgrad and wgrad alone are not measured."""

    memory_note = None

    def __init__(self, config: Configuration, coordinates_numpy, layer: LayerArrays, shape: LayerShape, torch):
        self.config, self.coordinates, self.layer, self.shape, self.torch = (
            config, coordinates_numpy, layer, shape, torch)
        self._layer = None

    def unsupported_reason(self, phase: str) -> str | None:
        config = self.config
        if config.dtype not in ("fp16", "fp32", TF32):
            return f"spconv 2.x runs fp16, fp32 and tf32, not {config.dtype}"
        if phase in ("dgrad", "wgrad"):
            return "spconv's backward computes both gradients at once: see the backward phase"
        if not spconv_matches_geometry(config.kernel_size, config.stride):
            return (f"spconv's kernel size {config.kernel_size}, stride {config.stride} layer has other output "
                    "voxels than ours (only submanifold and 2^3 stride-2 layers match)")
        if self.torch is None:
            return "spconv runs on CUDA GPUs with torch only"
        return spconv_import_error()

    def prepare(self, phase: str):
        if self._layer is None:
            host = self.layer.host
            self._layer = spconv_layer(self.torch, self.coordinates, host["features"], host["weight"],
                                       host["grad_output"], self.config.kernel_size, self.config.stride,
                                       self.config.batch_size, allow_tf32=self.config.dtype == TF32)
        layer = self._layer
        return {"forward": layer.forward, "backward": layer.backward, "both": layer.forward_backward}[phase]

    def dispatched(self, phase: str) -> str:
        return "spconv.SubMConv3d" if self.config.stride == 1 else "spconv.SparseConv3d"

    def resident_bytes(self, phase: str) -> int:
        arrays = [self.layer.host[name] for name in PHASE_INPUTS[phase]] + [self.layer.host["weight"]]
        return sum(array.nbytes for array in arrays) + self._pairs_bytes()

    def _pairs_bytes(self) -> int:
        """spconv's pair lists, about [2, K, N_out] int32 (its own layout, not measured)."""
        return 2 * self.shape.kernel_volume * self.shape.num_out * 4

    def estimate(self, phase: str) -> MemoryEstimate:
        return sparse_estimate(self.shape, phase, self.shape.bytes_of("weight"), self._pairs_bytes(), 0)


class DenseTorchLayer:
    """A dense `torch.nn.functional.conv3d` over the batch's bounding box: the same offsets and weights
    as ours (input padded by the offsets' reach; origin on a multiple of the stride, so output cell q
    is our coarse voxel q), every cell computed."""

    def __init__(self, torch, coordinates_numpy, features, weight, config: Configuration, device: str):
        """`features` `[N, C_in]` and `weight` `[K, C_in, C_out]`: ours, NumPy."""
        kernel_size, stride = config.kernel_size, config.stride
        dtype = getattr(torch, config.feature_dtype.name)
        self.torch, self.stride, self.device = torch, stride, device
        self.origin, shape = dense_grid(coordinates_numpy, kernel_size, stride)
        before = (kernel_size - 1) // 2  # the offsets run from -before to kernel_size - 1 - before
        self.input = torch.zeros((config.batch_size, config.in_channels, *shape), dtype=dtype, device=device)
        index = self._index(coordinates_numpy[:, 0], coordinates_numpy[:, 1:] - self.origin + before)
        # Through the accumulation dtype (exact): torch takes no ml_dtypes bfloat16 arrays.
        self.input[index] = torch.as_tensor(features.astype(accumulation_dtype(features.dtype))).to(
            device=device, dtype=dtype)
        dense_weight = to_torch_conv_weight(weight.astype(accumulation_dtype(weight.dtype)), kernel_size)
        self.weight = torch.as_tensor(dense_weight).to(device=device, dtype=dtype)
        output = self.forward()
        generator = torch.Generator().manual_seed(0)
        self.grad_output = torch.randn(output.shape, generator=generator).to(device=device, dtype=dtype)

    def forward(self):
        return self.torch.nn.functional.conv3d(self.input, self.weight, stride=self.stride)

    def dgrad(self):
        return self.torch.nn.grad.conv3d_input(self.input.shape, self.weight, self.grad_output, stride=self.stride)

    def wgrad(self):
        return self.torch.nn.grad.conv3d_weight(self.input, self.weight.shape, self.grad_output, stride=self.stride)

    def _index(self, batch, cells):
        """The advanced index of rows `[N, C]` at `batch`, `cells` of a `[B, C, *grid]` tensor."""
        columns = [self.torch.as_tensor(column, device=self.device) for column in (batch, *cells.T)]
        return columns[0], slice(None), *columns[1:]

    def output_rows(self, output, out_coordinates_numpy):
        """`output` `[B, C, *grid]` at our output voxels → `[N_out, C]` (for comparing with ours)."""
        cells = out_coordinates_numpy[:, 1:].astype(np.int64) - self.origin // self.stride
        return output[self._index(out_coordinates_numpy[:, 0], cells)]


def dense_grid(coordinates_numpy, kernel_size: int, stride: int) -> tuple[np.ndarray, list[int]]:
    """(origin, shape) of the dense input grid of a layer: the bounding box, its origin on a multiple
    of the stride, padded by the kernel offsets' reach on both sides."""
    spatial = coordinates_numpy[:, 1:].astype(np.int64)
    origin = spatial.min(axis=0) // stride * stride
    return origin, (spatial.max(axis=0) - origin + kernel_size).tolist()


class DenseTorchRunner:
    """torch's dense convolution of the layer (cuDNN on the GPU), for grids up to `--dense-max-cells`."""

    def __init__(self, config: Configuration, coordinates_numpy, layer: LayerArrays, shape: LayerShape, device,
                 max_cells: int):
        self.config, self.coordinates, self.layer, self.shape, self.device = (
            config, coordinates_numpy, layer, shape, device)
        self.torch = torch_module()
        self.grid_shape = dense_grid(coordinates_numpy, config.kernel_size, config.stride)[1]
        self.cells = config.batch_size * math.prod(self.grid_shape)
        self.max_cells = max_cells
        self._dense = None
        self.memory_note = "not measured (torch's CPU allocator is not traced)" if device == "cpu" else None

    def unsupported_reason(self, phase: str) -> str | None:
        if self.torch is None:
            return "torch is not importable"
        if self.device == "cuda" and not self.torch.cuda.is_available():
            return "this torch build sees no CUDA GPU"
        if self.cells > self.max_cells:
            return f"the dense grid has {self.cells:,} cells, more than --dense-max-cells {self.max_cells:,}"
        return None

    def dense(self) -> DenseTorchLayer:
        if self._dense is None:
            host = self.layer.host
            self._dense = DenseTorchLayer(self.torch, self.coordinates, host["features"], host["weight"], self.config,
                                          self.device)
        return self._dense

    def prepare(self, phase: str):
        dense = self.dense()
        return {
            "forward": dense.forward,
            "dgrad": dense.dgrad,
            "wgrad": dense.wgrad,
            "backward": lambda: (dense.dgrad(), dense.wgrad()),
            "both": lambda: (dense.forward(), dense.dgrad(), dense.wgrad()),
        }[phase]

    def dispatched(self, phase: str) -> str:
        return "torch.nn.functional.conv3d (dense)"

    def _dense_shape(self) -> LayerShape:
        """The layer's shape with every cell a row: what the dense convolution moves."""
        out_cells = self.config.batch_size * math.prod(
            (size - self.config.kernel_size) // self.config.stride + 1 for size in self.grid_shape)
        return LayerShape(self.cells, out_cells, self.config.in_channels, self.config.out_channels,
                          self.shape.kernel_volume, self.shape.dtype)

    def resident_bytes(self, phase: str) -> int:
        shape = self._dense_shape()
        return sum(shape.bytes_of(name) for name in PHASE_INPUTS[phase]) + shape.bytes_of("weight")

    def estimate(self, phase: str) -> MemoryEstimate:
        shape = self._dense_shape()
        return sparse_estimate(shape, phase, shape.bytes_of("weight"), 0, 0)
