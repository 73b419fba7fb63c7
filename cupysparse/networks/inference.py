"""Framework-free inference: a `cupysparse.networks.descriptions` description run on CuPy (GPU) or NumPy (CPU).

    weights = cupysparse.networks.weights_file.load_weights("minkunet18.safetensors")   # saved from PyTorch
    net = InferenceNetwork(networks.minkunet(18, 3, 13), weights, device="cuda", dtype="float16")
    logits = net(sparse_tensor).features

The weights are the PyTorch modules' `state_dict` (`adapters.torch.networks.save_weights`
writes them): every name of `networks.parameter_shapes` must be there with its shape. Batch
norm runs with its running statistics, as a PyTorch module in `eval()` mode; by default it is
folded into the convolution just before it (scale the weight's output channels, add a bias), so
inference runs one convolution and no normalisation pass.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from cupysparse.networks import descriptions as networks
from cupysparse.cuda.backend import array_module, default_device, to_device
from cupysparse.cuda.dtypes import accumulation_dtype, as_feature_dtype
from cupysparse.functional.convolution import spatially_sparse_conv
from cupysparse.networks.prefetch import prefetch_kernels
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.networks.weights_file import load_weights

# State-dict entries that carry no weight (PyTorch's BatchNorm counter).
IGNORED_SUFFIXES = (".num_batches_tracked",)


class LayerObserver:
    """Told about each convolution as it runs (what the demo's per-layer table and progress bar use).
    `input` / `output` are core `SparseTensor`s, `weight` the `[K, C_in, C_out]` array it ran with."""

    def before(self, path: str, layer: networks.Conv, input: SparseTensor) -> None:
        pass

    def after(self, path: str, layer: networks.Conv, input: SparseTensor, output: SparseTensor, weight) -> None:
        pass


def _check_weights(network: networks.Network, weights: Mapping) -> None:
    expected = networks.parameter_shapes(network)
    missing = [name for name in expected if name not in weights]
    unexpected = [name for name in weights if name not in expected and not name.endswith(IGNORED_SUFFIXES)]
    if missing or unexpected:
        raise ValueError(f"the weights do not fit {network.name}: missing {missing[:5]}"
                         f"{' …' if len(missing) > 5 else ''} ({len(missing)}), unexpected {unexpected[:5]}"
                         f"{' …' if len(unexpected) > 5 else ''} ({len(unexpected)})")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, {network.name} expects {shape}")


def _batch_norm_affine(weights: Mapping, path: str, layer: networks.BatchNorm) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) in float64 with `norm(x) = x · scale + shift` under the running statistics."""
    statistic = {name: np.asarray(weights[f"{path}.{name}"], dtype=np.float64)
                 for name in ("weight", "bias", "running_mean", "running_var")}
    scale = statistic["weight"] / np.sqrt(statistic["running_var"] + layer.eps)
    return scale, statistic["bias"] - statistic["running_mean"] * scale


def _sequence_paths(layer, path: str):
    """(path, child) of the layers that run one after another inside `layer`."""
    sequence = layer.layers if isinstance(layer, networks.Sequential) else layer.body
    return [(f"{path}.{child.name}" if path else child.name, child) for child in sequence]


class InferenceNetwork:
    """A network description with its weights on one device, callable on core `SparseTensor`s.

    `weights`: a mapping name → array (NumPy, or anything NumPy converts) or the path of a weights
    file. `device`: 'cuda', 'cpu' or 'auto'; `dtype`: the feature dtype (default float16 on the GPU,
    float32 on the CPU). `fwd_algo` chooses the convolution algorithms as in the functional API.
    On a GPU, the kernels the tuning caches say the convolutions will run start loading in the
    background, and the network then rehearses its call on a few voxels (`cupysparse.networks.prefetch`, unless
    `prefetch=False`); `prefetched` is that `KernelPrefetch`, or None. A call stops what is left of it.
    """

    def __init__(self, network: networks.Network, weights, device: str = "auto", dtype=None,
                 fold_batch_norm: bool = True, fwd_algo=None, prefetch: bool = True):
        if not isinstance(network, networks.Network):
            raise TypeError(f"network must be a cupysparse.networks.descriptions.Network, got {type(network).__name__}")
        if isinstance(weights, (str, os.PathLike)):
            weights = load_weights(weights)
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping of names to arrays or a file path, got "
                            f"{type(weights).__name__}")
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
        self.network = network
        self._map_requests = networks.map_requests(network)
        self.device = default_device() if device == "auto" else device
        self.dtype = as_feature_dtype(dtype if dtype is not None else "float16" if self.device == "cuda" else "float32")
        self.fwd_algo = fwd_algo
        _check_weights(network, weights)
        self._convs: dict[str, tuple] = {}  # path → (weight, bias or None) on the device, `Conv.geometry()`
        self._norms: dict[str, tuple] = {}  # path → (scale, shift) on the device, for batch norms not folded
        self._prepare(weights, fold_batch_norm)
        self.prefetched = None
        if prefetch and self.device == "cuda":
            self.prefetched = prefetch_kernels(network, self.dtype, algorithms={"forward": fwd_algo},
                                               rehearse=self._forward)

    def _prepare(self, weights: Mapping, fold_batch_norm: bool) -> None:
        folded = {}  # convolution path → (path, layer) of the batch norm that follows it
        for path, layer in networks.walk(self.network.root):
            if fold_batch_norm and isinstance(layer, (networks.Sequential, networks.Residual)):
                sequence = _sequence_paths(layer, path)
                for (conv_path, conv), norm in zip(sequence, sequence[1:]):
                    if isinstance(conv, networks.Conv) and isinstance(norm[1], networks.BatchNorm):
                        folded[conv_path] = norm
        folded_norms = {norm_path for norm_path, _ in folded.values()}
        compute = accumulation_dtype(self.dtype)
        for path, layer in networks.walk(self.network.root):
            if isinstance(layer, networks.Conv):
                self._convs[path] = (*self._conv_arrays(weights, path, layer, folded.get(path)), layer.geometry())
            elif isinstance(layer, networks.BatchNorm) and path not in folded_norms:
                affine = _batch_norm_affine(weights, path, layer)
                self._norms[path] = tuple(to_device(value.astype(compute), self.device) for value in affine)

    def _conv_arrays(self, weights: Mapping, path: str, layer: networks.Conv, norm) -> tuple:
        """(weight, bias or None) on the device, with the batch norm `norm` (path, layer) folded in."""
        weight = np.asarray(weights[f"{path}.weight"], dtype=np.float64)
        bias = np.asarray(weights[f"{path}.bias"], dtype=np.float64) if layer.bias else None
        if norm is not None:
            scale, shift = _batch_norm_affine(weights, *norm)
            weight = weight * scale
            bias = shift if bias is None else bias * scale + shift
        return tuple(None if array is None else to_device(array.astype(self.dtype), self.device)
                     for array in (weight, bias))

    def __call__(self, input: SparseTensor, observer: LayerObserver | None = None) -> SparseTensor:
        if not isinstance(input, SparseTensor):
            raise TypeError(f"input must be a cupysparse.SparseTensor, got {type(input).__name__}")
        if input.device != self.device:
            raise ValueError(f"input is on {input.device} but the network's weights are on {self.device}")
        if input.dtype != self.dtype:
            raise TypeError(f"input features are {input.dtype} but the network runs in {self.dtype}; cast them")
        if input.num_channels != self.network.in_channels:
            raise ValueError(f"{self.network.name} takes {self.network.in_channels} input channels, "
                             f"got {input.num_channels}")
        if self.prefetched is not None:
            self.prefetched.stop()
        return self._forward(input, observer)

    def _forward(self, input: SparseTensor, observer: LayerObserver | None = None) -> SparseTensor:
        # Every map of the network: over the input's coordinates before its first layer, the rest when a layer first
        # needs one, while the GPU runs the layers before it. The build holds the caches that padded convolutions'
        # outputs start until the layers that run in them.
        built = input.map_cache.start_maps(networks.requests_at(self._map_requests, input.tensor_stride))
        output = self._run(self.network.root, "", input, {}, observer or LayerObserver())
        del built
        return output

    def _run(self, layer, path: str, tensor: SparseTensor, skips: dict, observer: LayerObserver) -> SparseTensor:
        if isinstance(layer, networks.Conv):
            weight, bias, (kernel_size, stride, dilation, padding) = self._convs[path]
            observer.before(path, layer, tensor)
            output = spatially_sparse_conv(tensor, weight, kernel_size, stride, dilation, layer.transposed,
                                           bias=bias, fwd_algo=self.fwd_algo, padding=padding)
            observer.after(path, layer, tensor, output, weight)
            return output
        if isinstance(layer, networks.BatchNorm):
            if path not in self._norms:  # folded into the convolution before it
                return tensor
            return tensor.replace_features(self._affine(tensor.features, *self._norms[path]))
        if isinstance(layer, networks.ReLU):
            return tensor.replace_features(array_module(tensor.features).maximum(tensor.features, 0))
        if isinstance(layer, networks.Sequential):
            for child_path, child in _sequence_paths(layer, path):
                if isinstance(child, networks.SaveSkip):
                    skips[child.name] = tensor
                elif isinstance(child, networks.ConcatSkip):
                    tensor = _concatenate(tensor, skips.pop(child.skip), child.skip)
                else:
                    tensor = self._run(child, child_path, tensor, skips, observer)
            return tensor
        if isinstance(layer, networks.Residual):
            output = tensor
            for child_path, child in _sequence_paths(layer, path):
                output = self._run(child, child_path, output, skips, observer)
            identity = tensor
            if layer.shortcut is not None:
                shortcut_path = f"{path}.{layer.shortcut.name}" if path else layer.shortcut.name
                identity = self._run(layer.shortcut, shortcut_path, tensor, skips, observer)
            xp = array_module(output.features)
            return output.replace_features(xp.maximum(output.features + identity.features, 0))
        raise TypeError(f"cannot run {type(layer).__name__}")

    @staticmethod
    def _affine(features, scale, shift):
        compute = accumulation_dtype(features.dtype)
        return (features.astype(compute) * scale + shift).astype(features.dtype)


def _concatenate(current: SparseTensor, skip: SparseTensor, skip_name: str) -> SparseTensor:
    if current.coordinates is not skip.coordinates:
        raise ValueError(f"the tensor saved as {skip_name!r} has other coordinates than the one it is appended to")
    xp = array_module(current.features)
    return current.replace_features(xp.concatenate([current.features, skip.features], axis=1))
