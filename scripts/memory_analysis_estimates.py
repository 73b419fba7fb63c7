"""The memory estimates of the memory analysis (`benchmark_memory_analysis`): the bytes of one call's
inputs, outputs, weights and kernel map, and the temporary bytes the algorithm reports
(`Algorithm.transient_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PHASE_INPUTS = {
    "forward": ("features",),
    "dgrad": ("grad_output",),
    "wgrad": ("features", "grad_output"),
    "backward": ("features", "grad_output"),
    "both": ("features", "grad_output"),
}
PHASE_OUTPUTS = {
    "forward": ("output",),
    "dgrad": ("grad_input",),
    "wgrad": ("grad_weight",),
    "backward": ("grad_input", "grad_weight"),
    "both": ("output", "grad_input", "grad_weight"),
}
BREAKDOWN_PARTS = ("features", "output", "weights", "kernel_map", "workspace")


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a layer's arrays."""

    num_in: int
    num_out: int
    in_channels: int
    out_channels: int
    kernel_volume: int
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def bytes_of(self, name: str) -> int:
        elements = {
            "features": self.num_in * self.in_channels,
            "grad_input": self.num_in * self.in_channels,
            "grad_output": self.num_out * self.out_channels,
            "output": self.num_out * self.out_channels,
            "grad_weight": self.kernel_volume * self.in_channels * self.out_channels,
            "weight": self.kernel_volume * self.in_channels * self.out_channels,
        }[name]
        return elements * self.itemsize


@dataclass
class MemoryEstimate:
    """The bytes one call holds: what it reads and writes, its weights and kernel map, and its temporaries."""

    features: int
    output: int
    weights: int
    kernel_map: int
    workspace: int

    @property
    def total(self) -> int:
        return self.features + self.output + self.weights + self.kernel_map + self.workspace


def sparse_estimate(shape: LayerShape, phase: str, weights: int, kernel_map: int, workspace: int) -> MemoryEstimate:
    return MemoryEstimate(
        features=sum(shape.bytes_of(name) for name in PHASE_INPUTS[phase]),
        output=sum(shape.bytes_of(name) for name in PHASE_OUTPUTS[phase]),
        weights=weights, kernel_map=kernel_map, workspace=workspace,
    )
