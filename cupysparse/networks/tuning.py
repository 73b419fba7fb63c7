"""A network's convolutions on a scene, each layer's problem handed to a tuner forward and backward:
what fills a tuning cache for a network (`cupysparse-populate-shipped-cache`), and what makes a
warm-up process run every candidate kernel once (`python -m cupysparse warmup`).

The network runs framework-free (`InferenceNetwork`, random weights) with its own convolutions on
`explicit_gemm`, a single candidate, so the default tuner measures and stores nothing. An observer
gives each convolution's real input, kernel map and weight to the tuner passed in, as the functional
API would on its first call (same problem, same runners), with a random output gradient for the
backward. The keys are those a training or inference run of the network on the same scene meets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cupysparse.networks import descriptions as networks
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.cuda.backend import array_module
from cupysparse.functional.execution import backward_runner, forward_runner
from cupysparse.networks.inference import InferenceNetwork, LayerObserver
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import Tuner, tuning_key

PHASES = ("forward", "backward")
# The network's own pass only produces each layer's input: one candidate, nothing measured.
PASS_THROUGH_ALGORITHM = "explicit_gemm"


@dataclass(frozen=True)
class LayerChoice:
    """What the tuner chose for one convolution and phase; `measured` when it benchmarked for it."""

    path: str
    phase: str
    key: tuple
    algorithm: str
    params: dict
    measured: bool


class _TuningObserver(LayerObserver):
    def __init__(self, tuner: Tuner, phases, algorithms: dict, seed: int, on_layer):
        self._tuner, self._phases, self._algorithms = tuner, phases, algorithms
        self._seed, self._on_layer = seed, on_layer
        self._layers_done = 0
        self.choices: list[LayerChoice] = []

    def after(self, path, layer, input: SparseTensor, output: SparseTensor, weight) -> None:
        kernel_size, stride, dilation, padding = layer.geometry()  # the map the layer ran on, padded or not
        kernel_map = input.kernel_map(kernel_size, stride, dilation, layer.transposed, padding=padding).kernel_map
        features = input.features
        problem = ConvProblem.of(features, kernel_map, layer.out_channels)
        for phase in self._phases:
            if phase == "forward":
                run = forward_runner(features, weight, kernel_map)
            else:
                run = backward_runner(self._output_gradient(kernel_map.num_out, layer, features), features, weight,
                                      kernel_map)
            measured_before = self._tuner.measurements
            search_space = parse_algorithm_filter(self._algorithms[phase], CONV, phase)
            chosen = self._tuner.select(search_space, problem, run)
            self.choices.append(LayerChoice(path, phase, tuning_key(problem), chosen.algorithm.name,
                                            dict(chosen.params), self._tuner.measurements > measured_before))
        self._layers_done += 1
        if self._on_layer is not None:
            self._on_layer(path, self._layers_done)

    def _output_gradient(self, num_out: int, layer: networks.Conv, features):
        xp = array_module(features)
        rng = xp.random.default_rng([self._seed, num_out, layer.in_channels, layer.out_channels])
        return rng.standard_normal((num_out, layer.out_channels), dtype=np.float32).astype(features.dtype)


def tune_network(network: networks.Network, tensor: SparseTensor, tuner: Tuner, phases=PHASES, fwd_algo=None,
                 bwd_algo=None, seed: int = 0, on_layer=None) -> list[LayerChoice]:
    """Run `network` on `tensor` (its device and dtype; `network.in_channels` features) and have
    `tuner` choose each convolution's algorithm for `phases` in the search spaces `fwd_algo` /
    `bwd_algo` (None: the environment variables, else `auto`). `on_layer(path, convolutions done)` is
    called after each convolution. Returns the choices in running order."""
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        raise ValueError(f"phases must be some of {PHASES}, got {tuple(phases)}")
    observer = _TuningObserver(tuner, tuple(phases), {"forward": fwd_algo, "backward": bwd_algo}, seed, on_layer)
    runner = InferenceNetwork(network, networks.random_weights(network, seed), tensor.device, tensor.dtype,
                              fwd_algo=PASS_THROUGH_ALGORITHM, prefetch=False)
    runner(tensor, observer)
    return observer.choices
