"""spconv 2.x running one of our network descriptions with our weights: the peer the network benchmark
compares against (`cupysparse.scripts.benchmark_network`).

The network is built from `model.description`: SubMConv3d with one indice_key per (resolution level,
kernel size), so layers reuse pairs as ours reuse maps; SparseConv3d (2^3, stride 2, padding 0) for the
strided convolutions, each with its own key, which the SparseInverseConv3d inverting it reuses, and
SparseConv3d with their padding for the padded ones (spconv's rules are theirs); torch
BatchNorm1d and ReLU on the features. It gets our weights, converted to its layout, and our batch-norm
statistics. Its coordinates are shifted by a multiple of the coarsest level's stride (non-negative, and
every level's coordinates floor(x / stride) stay ours).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from cupysparse.geometry.coords import as_tuple
from cupysparse.geometry.padding import spconv_grid
from cupysparse.networks import descriptions as networks
from cupysparse.networks.weight_layouts import to_spconv_weight

SPATIAL_DIMS = 3


class IndiceKeys:
    """spconv's indice_key of each convolution, handed out in running order: submanifold layers
    share one key per (resolution level, kernel size), as they share our maps; each strided
    convolution gets its own, which the transposed convolution inverting it reuses."""

    def __init__(self):
        self.level = 0
        self._open = []  # (key, kernel size) of the strided convolutions not inverted yet, innermost last

    def submanifold(self, kernel_size) -> str:
        return f"subm{self.level}_k{'x'.join(map(str, kernel_size))}"

    def strided(self, kernel_size) -> str:
        key = f"down{self.level}"
        self._open.append((key, kernel_size))
        self.level += 1
        return key

    def transposed(self, kernel_size) -> str:
        if not self._open:
            raise ValueError("a transposed convolution with no strided convolution before it to invert")
        key, strided_kernel = self._open.pop()
        if strided_kernel != kernel_size:  # spconv's inverse convolution reuses the pairs as they are
            raise ValueError(f"a transposed convolution of kernel {kernel_size} cannot invert {key}, whose kernel "
                             f"is {strided_kernel}")
        self.level -= 1
        return key


class SpconvSequential(nn.Module):
    """The layers of a `networks.Sequential` on spconv tensors, skip saves and concatenations included
    (mirrors the adapter's `SparseSequential`)."""

    def __init__(self, description: networks.Sequential, spconv, keys: IndiceKeys):
        super().__init__()
        self._steps = []
        for layer in description.layers:
            if isinstance(layer, (networks.SaveSkip, networks.ConcatSkip)):
                self._steps.append(layer)
            else:
                self.add_module(layer.name, spconv_module(layer, spconv, keys))
                self._steps.append(layer.name)

    def forward(self, input, skips: dict | None = None):
        skips = {} if skips is None else skips
        output = input
        for step in self._steps:
            if isinstance(step, networks.SaveSkip):
                skips[step.name] = output
            elif isinstance(step, networks.ConcatSkip):
                skip = skips.pop(step.skip)
                output = output.replace_feature(torch.cat([output.features, skip.features], 1))
            else:
                module = getattr(self, step)
                output = module(output, skips) if isinstance(module, SpconvSequential) else module(output)
        return output


class SpconvResidual(nn.Module):
    """`relu(body(x) + shortcut(x))` of a `networks.Residual` (mirrors the adapter's `ResidualBlock`)."""

    def __init__(self, description: networks.Residual, spconv, keys: IndiceKeys):
        super().__init__()
        self._body = []
        for layer in description.body:
            self.add_module(layer.name, spconv_module(layer, spconv, keys))
            self._body.append(layer.name)
        self.shortcut = None
        if description.shortcut is not None:
            self.shortcut = SpconvSequential(description.shortcut, spconv, keys)

    def forward(self, input):
        output = input
        for name in self._body:
            output = getattr(self, name)(output)
        identity = input if self.shortcut is None else self.shortcut(input)
        return output.replace_feature(torch.relu(output.features + identity.features))


class SpconvBatchNorm(nn.BatchNorm1d):
    def forward(self, input):
        return input.replace_feature(super().forward(input.features))


class SpconvReLU(nn.Module):
    def forward(self, input):
        return input.replace_feature(torch.relu(input.features))


def spconv_convolution(layer: networks.Conv, spconv, keys: IndiceKeys) -> nn.Module:
    kernel_size = as_tuple(layer.kernel_size, SPATIAL_DIMS, "kernel_size")
    kind = layer.kind()
    if layer.padding is not None:  # spconv's own padded convolution, which ours computes as it does
        if layer.transposed:
            raise ValueError(f"{layer.name}: a padded transposed convolution has no spconv counterpart here")
        return spconv.SparseConv3d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                                   padding=layer.padding, bias=layer.bias, indice_key=keys.strided(kernel_size))
    if kind == "submanifold":
        return spconv.SubMConv3d(layer.in_channels, layer.out_channels, layer.kernel_size, bias=layer.bias,
                                 indice_key=keys.submanifold(kernel_size))
    # spconv's strided pairs are ours only where the kernel tiles the stride, offsets 0..k-1 (a 2^3
    # kernel at stride 2): larger kernels give outputs ours do not have.
    if any(k != s or k > 2 for k, s in zip(kernel_size, as_tuple(layer.stride, SPATIAL_DIMS, "stride"))):
        raise ValueError(f"{layer.name}: spconv's {kind} convolution of kernel {layer.kernel_size}, stride "
                         f"{layer.stride} has other output voxels than ours; only kernel = stride = 2 matches")
    if kind == "strided":
        return spconv.SparseConv3d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                                   padding=0, bias=layer.bias, indice_key=keys.strided(kernel_size))
    return spconv.SparseInverseConv3d(layer.in_channels, layer.out_channels, layer.kernel_size,
                                      indice_key=keys.transposed(kernel_size), bias=layer.bias)


def spconv_module(layer, spconv, keys: IndiceKeys) -> nn.Module:
    """The spconv-side module of one layer description; `spconv` is the `spconv.pytorch` namespace."""
    return networks.build_layer(layer, "spconv", {
        networks.Conv: lambda conv: spconv_convolution(conv, spconv, keys),
        networks.BatchNorm: lambda norm: SpconvBatchNorm(norm.channels, eps=norm.eps, momentum=norm.momentum),
        networks.ReLU: lambda relu: SpconvReLU(),
        networks.Sequential: lambda sequential: SpconvSequential(sequential, spconv, keys),
        networks.Residual: lambda residual: SpconvResidual(residual, spconv, keys),
    })


def build_spconv_network(description: networks.Network, spconv) -> SpconvSequential:
    """`description` with spconv modules, named as the adapter names its modules, so parameter names
    are ours: `encoder1.block0.conv1.weight`."""
    return SpconvSequential(description.root, spconv, IndiceKeys())


def spconv_weight(weight: torch.Tensor, layer: networks.Conv) -> torch.Tensor:
    """Our `[K, C_in, C_out]` weight as the spconv layer of `layer` must hold it to compute the same."""
    kernel_size = as_tuple(layer.kernel_size, SPATIAL_DIMS, "kernel_size")
    if layer.kernel_volume() == 1:
        # spconv 2.x runs a 1x1x1 convolution as `features @ weight.view(C_in, C_out)` on its
        # [C_out, 1, 1, 1, C_in] weight (its issue #450): the memory must hold our [C_in, C_out]
        # matrix as it is, not the transpose its layout would suggest.
        return weight.detach().reshape(layer.out_channels, *kernel_size, layer.in_channels).clone()
    converted = to_spconv_weight(weight.detach().float().cpu().numpy(), kernel_size)
    return torch.from_numpy(converted).to(device=weight.device, dtype=weight.dtype)


def copy_weights_to_spconv(model: nn.Module, spconv_model: nn.Module) -> None:
    """Give `spconv_model` (from `build_spconv_network(model.description, ...)`) `model`'s parameters
    and batch-norm statistics, so both compute the same function."""
    convolutions = dict(networks.convolutions(model.description))
    source = model.state_dict()
    target = spconv_model.state_dict()  # tensors sharing the parameters' memory
    if source.keys() != target.keys():
        only_ours, only_theirs = sorted(source.keys() - target.keys()), sorted(target.keys() - source.keys())
        raise ValueError(f"the spconv network's parameters differ from ours: only ours {only_ours}, only spconv's "
                         f"{only_theirs}")
    with torch.no_grad():
        for name, value in source.items():
            path, _, kind = name.rpartition(".")
            if path in convolutions and kind == "weight":
                value = spconv_weight(value, convolutions[path])
            if value.shape != target[name].shape:
                raise ValueError(f"{name}: ours converts to {tuple(value.shape)}, spconv's is "
                                 f"{tuple(target[name].shape)}")
            target[name].copy_(value)


def import_peer():
    """`spconv.pytorch`, or None with the reason on stderr."""
    try:
        import spconv.pytorch as spconv
    except Exception as error:  # absent or broken: the benchmark still runs cupysparse
        print(f"spconv not importable ({type(error).__name__}: {error}); cupysparse only", file=sys.stderr)
        return None
    return spconv


def peer_network(spconv, model: nn.Module, coordinates: np.ndarray, features: torch.Tensor, batch_size: int):
    """`model`'s network and weights in spconv over `coordinates` (shifted onto spconv's grid):
    (the spconv model, a maker of a fresh input tensor, and a reader of an output's voxels in our
    coordinates and its features)."""
    spconv_model = build_spconv_network(model.description, spconv).to(device=features.device,
                                                                      dtype=next(model.parameters()).dtype)
    copy_weights_to_spconv(model, spconv_model)
    shifted, spatial_shape = spconv_grid(coordinates, networks.coarsest_stride(model.description))
    if networks.has_padding(model.description) and not np.array_equal(shifted, coordinates):
        # The output rows are coarse voxels, which a shift of the input's would not map back to ours.
        raise ValueError("a network with padded convolutions needs coordinates already on spconv's grid "
                         "(`spconv_grid`), the same for every library")
    indices = torch.from_numpy(shifted).to(features.device)
    shift = torch.from_numpy(shifted[:1] - coordinates[:1]).to(features.device)

    def output_voxels(output):
        return output.indices - shift, output.features

    return spconv_model, lambda: spconv.SparseConvTensor(features, indices, spatial_shape, batch_size), output_voxels
