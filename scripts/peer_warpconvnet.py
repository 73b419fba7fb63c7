"""A network description built with NVIDIA WarpConvNet (`import warpconvnet`, read at 1.8.2), holding our
weights and running on our voxels, so the network benchmark can compare it with ours output for output.

How its API gives our semantics (paths in the NVlabs/WarpConvNet repository):
- geometry: `Voxels(spatial coordinates [N, 3] int32, features [N, C], offsets=[0, N_0, N_0 + N_1, ..., N])`, the
  rows grouped by batch item and kept in the order given; the offsets live on the CPU
  (warpconvnet/geometry/types/voxels.py, geometry/base/batched.py). Its hash keys hold each coordinate in 18 signed
  bits and the batch index in 9 (warpconvnet/csrc/include/cuhash/hash_functions.cuh).
- `SparseConv3d(C_in, C_out, kernel_size, stride, bias=..., transposed=...)` (warpconvnet/nn/modules/sparse_conv.py),
  forward `(input, output_spatially_sparse_tensor=None)`, computed by `spatially_sparse_conv`
  (warpconvnet/nn/functional/sparse_conv/helper.py): stride 1 keeps the input's coordinates and rows; stride s
  outputs unique(floor(x / s)) (`stride_coords`, warpconvnet/geometry/coords/ops/stride.py) and pairs
  `in = out * s + o_k`; transposed (not generative) outputs exactly the coordinates, in the row order, of the
  tensor it is given, through the strided map with input and output swapped. Each map goes into a cache made on
  the first convolution's input and handed on to every tensor derived from it, keyed by kernel, transposedness
  and the batch offsets of input and output (`IntSearchCacheKey`, warpconvnet/geometry/coords/search/cache.py):
  layers of one level share a map, a transposed convolution reuses the strided one's, and a new `Voxels`
  starts with none. One hazard: an odd kernel whose input and output have as many rows gets its centre offset
  marked the identity, row i to row i (`generate_kernel_map`, torch_discrete.py), which every backend but
  mask_gemm runs as such: wrong for a strided convolution that merges no voxels (MinkUNet's are 2^3, even).
- kernel offsets (`kernel_offsets_from_size`, warpconvnet/geometry/coords/search/torch_discrete.py, and
  `packed_kernel_map_size`, warpconvnet/csrc/include/cuhash/kernel_map.cuh): k runs over the axes row-major, the
  first coordinate column slowest, offset `d - size // 2` along an odd axis and `d` along an even one: ours
  (`coords.offset_range`) for sizes 1, 2 and every odd size, not for 4, 6, ...
- weight `[K, C_in, C_out]`, offset k applied as `in[pair] @ weight[k]`
  (warpconvnet/nn/functional/sparse_conv/detail/explicit.py): our layout and our function, so weights copy as
  they are.
- the GEMM behind each layer is picked by benchmarking candidates the first time a shape comes (algorithm pools
  WARPCONVNET_FWD_ALGO_MODE / _DGRAD_ / _WGRAD_, default "auto"), keyed by log10 of the row counts, channels,
  kernel volume, dtype, stride and transposedness, and kept in WARPCONVNET_BENCHMARK_CACHE_DIR
  (~/.cache/warpconvnet; warpconvnet/constants.py, warpconvnet/utils/benchmark_cache.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from cupysparse.geometry.coords import as_tuple
from cupysparse.networks import descriptions as networks

SPATIAL_DIMS = 3
# WarpConvNet packs (batch, x, y, z) into 9 + 3 x 18 bits (csrc/include/cuhash/hash_functions.cuh).
MAX_BATCH_INDEX = 2**9 - 1
COORDINATE_BITS = 18
# Neighbours are packed as x + o: kept this far inside the 18-bit range, no kernel's reach wraps around.
COORDINATE_MARGIN = 64


def import_peer():
    """WarpConvNet's `Voxels` and `SparseConv3d` and its `version`, or None with the reason on stderr."""
    try:
        import warpconvnet
        from warpconvnet.geometry.types.voxels import Voxels
        from warpconvnet.nn.modules.sparse_conv import SparseConv3d
    except Exception as error:  # noqa: BLE001 - absent, or its compiled extension broken: cupysparse still runs
        print(f"warpconvnet not importable ({type(error).__name__}: {error}); cupysparse only", file=sys.stderr)
        return None
    return SimpleNamespace(Voxels=Voxels, SparseConv3d=SparseConv3d, version=warpconvnet.__version__)



# --------------------------------------------------------------------------------------------
# The network


class StridePairing:
    """Checks, in running order, that every transposed convolution inverts an open strided one of its stride
    (innermost first): the one whose input the forward hands it as its output coordinates."""

    def __init__(self):
        self._open = []  # (name, stride) of the strided convolutions not inverted yet, innermost last

    def strided(self, layer: networks.Conv) -> None:
        self._open.append((layer.name, as_tuple(layer.stride, SPATIAL_DIMS, "stride")))

    def transposed(self, layer: networks.Conv) -> None:
        if not self._open:
            raise ValueError(f"{layer.name}: a transposed convolution with no strided convolution before it to invert")
        name, stride = self._open.pop()
        if stride != as_tuple(layer.stride, SPATIAL_DIMS, "stride"):
            raise ValueError(f"{layer.name}: a transposed convolution of stride {layer.stride} cannot invert {name}, "
                             f"whose stride is {stride}")


@dataclass
class ForwardState:
    """What one forward carries between layers: the tensors saved as skips, and the input of each strided
    convolution not inverted yet (innermost last), which gives the transposed one inverting it its coordinates."""

    skips: dict = field(default_factory=dict)
    finer: list = field(default_factory=list)


def _register(owner: nn.Module, layer, warpconvnet, pairing: StridePairing) -> tuple[str, str | None]:
    """Adds the module of `layer` to `owner`; returns its step: (module name, convolution kind or None)."""
    owner.add_module(layer.name, warpconvnet_module(layer, warpconvnet, pairing))
    return layer.name, layer.kind() if isinstance(layer, networks.Conv) else None


def _run(owner: nn.Module, step: tuple[str, str | None], input, state: ForwardState):
    name, kind = step
    module = getattr(owner, name)
    if kind == "transposed":
        return module(input, state.finer.pop())
    if kind == "strided":
        state.finer.append(input)
    if isinstance(module, (WarpConvNetSequential, WarpConvNetResidual)):
        return module(input, state)
    return module(input)


class WarpConvNetSequential(nn.Module):
    """The layers of a `networks.Sequential` on `Voxels`, skip saves and concatenations included (mirrors the
    adapter's `SparseSequential`)."""

    def __init__(self, description: networks.Sequential, warpconvnet, pairing: StridePairing):
        super().__init__()
        self._steps = []
        for layer in description.layers:
            if isinstance(layer, (networks.SaveSkip, networks.ConcatSkip)):
                self._steps.append(layer)
            else:
                self._steps.append(_register(self, layer, warpconvnet, pairing))

    def forward(self, input, state: ForwardState | None = None):
        state = ForwardState() if state is None else state
        output = input
        for step in self._steps:
            if isinstance(step, networks.SaveSkip):
                state.skips[step.name] = output
            elif isinstance(step, networks.ConcatSkip):
                output = _concatenate(output, state.skips.pop(step.skip), step.skip)
            else:
                output = _run(self, step, output, state)
        return output


def _concatenate(current, skip, skip_name: str):
    # The rows align: a transposed convolution returns the skip's coordinates in the skip's row order, and
    # submanifold layers keep rows. Equal batch offsets (on the host, free to compare) catch a skip of another level.
    if not torch.equal(current.offsets.long(), skip.offsets.long()):
        raise ValueError(f"the tensor saved as {skip_name!r} has other coordinates than the one it is appended to")
    return current.replace(batched_features=torch.cat([current.feature_tensor, skip.feature_tensor], 1))


class WarpConvNetResidual(nn.Module):
    """`relu(body(x) + shortcut(x))` of a `networks.Residual` (mirrors the adapter's `ResidualBlock`)."""

    def __init__(self, description: networks.Residual, warpconvnet, pairing: StridePairing):
        super().__init__()
        self._body = [_register(self, layer, warpconvnet, pairing) for layer in description.body]
        self.shortcut = None
        if description.shortcut is not None:
            self.shortcut = WarpConvNetSequential(description.shortcut, warpconvnet, pairing)

    def forward(self, input, state: ForwardState):
        output = input
        for step in self._body:
            output = _run(self, step, output, state)
        identity = input if self.shortcut is None else self.shortcut(input, state)
        return output.replace(batched_features=torch.relu(output.feature_tensor + identity.feature_tensor))


class WarpConvNetBatchNorm(nn.BatchNorm1d):
    def forward(self, input):
        return input.replace(batched_features=super().forward(input.feature_tensor))


class WarpConvNetReLU(nn.Module):
    def forward(self, input):
        return input.replace(batched_features=torch.relu(input.feature_tensor))


def warpconvnet_convolution(layer: networks.Conv, warpconvnet, pairing: StridePairing) -> nn.Module:
    kernel_size = as_tuple(layer.kernel_size, SPATIAL_DIMS, "kernel_size")
    if any(size % 2 == 0 and size > 2 for size in kernel_size):
        raise ValueError(f"{layer.name}: WarpConvNet's offsets along an axis of even size {kernel_size} start at 0, "
                         "ours at -(size - 1) // 2; only sizes 1, 2 and odd ones match")
    if layer.padding is not None:
        raise ValueError(f"{layer.name}: WarpConvNet has no padded convolution (spconv's output rule)")
    kind = layer.kind()
    if kind == "strided":
        pairing.strided(layer)
    elif kind == "transposed":
        pairing.transposed(layer)
    return warpconvnet.SparseConv3d(layer.in_channels, layer.out_channels, kernel_size,
                                    stride=as_tuple(layer.stride, SPATIAL_DIMS, "stride"), bias=layer.bias,
                                    transposed=layer.transposed)


def warpconvnet_module(layer, warpconvnet, pairing: StridePairing) -> nn.Module:
    """The WarpConvNet-side module of one layer description; `warpconvnet` is `import_peer()`'s namespace."""
    return networks.build_layer(layer, "WarpConvNet", {
        networks.Conv: lambda conv: warpconvnet_convolution(conv, warpconvnet, pairing),
        networks.BatchNorm: lambda norm: WarpConvNetBatchNorm(norm.channels, eps=norm.eps, momentum=norm.momentum),
        networks.ReLU: lambda relu: WarpConvNetReLU(),
        networks.Sequential: lambda sequential: WarpConvNetSequential(sequential, warpconvnet, pairing),
        networks.Residual: lambda residual: WarpConvNetResidual(residual, warpconvnet, pairing),
    })


def build_warpconvnet_network(description: networks.Network, warpconvnet) -> WarpConvNetSequential:
    """`description` with WarpConvNet modules, named as the adapter names its modules, so parameter names are
    ours: `encoder1.block0.conv1.weight`. Its forward takes a `Voxels` and returns one."""
    return WarpConvNetSequential(description.root, warpconvnet, StridePairing())


def copy_weights_to_warpconvnet(model: nn.Module, warpconvnet_model: nn.Module) -> None:
    """Give `warpconvnet_model` (from `build_warpconvnet_network(model.description, ...)`) `model`'s parameters and
    batch-norm statistics, so both compute the same function. A `SparseConv3d` weight is ours as it is: `[K, C_in,
    C_out]`, offsets in our order (see the module docstring), a transposed one `[C_in coarse, C_out fine]` per
    offset like ours."""
    source, target = model.state_dict(), warpconvnet_model.state_dict()  # target: tensors sharing the parameters
    if source.keys() != target.keys():
        only_ours, only_theirs = sorted(source.keys() - target.keys()), sorted(target.keys() - source.keys())
        raise ValueError(f"the WarpConvNet network's parameters differ from ours: only ours {only_ours}, only "
                         f"WarpConvNet's {only_theirs}")
    with torch.no_grad():
        for name, value in source.items():
            if value.shape != target[name].shape:
                raise ValueError(f"{name}: ours is {tuple(value.shape)}, WarpConvNet's {tuple(target[name].shape)}")
            target[name].copy_(value)


# --------------------------------------------------------------------------------------------
# Input and output


def batch_offsets(coordinates: torch.Tensor, batch_size: int = 0) -> torch.Tensor:
    """WarpConvNet's batch offsets of our int32 `[N, 4]` coordinates: int32 on the CPU, `[0, N_0, N_0 + N_1, ...,
    N]`, at least `batch_size` items. Checks what WarpConvNet takes without checking (rows grouped by increasing
    batch index, values its hash keys hold), so it synchronises: compute it once, outside the timed runs."""
    batch, spatial = coordinates[:, 0], coordinates[:, 1:]
    if len(batch) and bool((batch[1:] < batch[:-1]).any()):
        raise ValueError("WarpConvNet needs the rows grouped by batch index, in increasing order")
    limit = 2 ** (COORDINATE_BITS - 1) - COORDINATE_MARGIN
    if len(batch) and (int(batch.min()) < 0 or int(batch.max()) > MAX_BATCH_INDEX or int(spatial.abs().max()) > limit):
        raise ValueError(f"WarpConvNet holds batch indices 0..{MAX_BATCH_INDEX} and coordinates within ±{limit}")
    counts = torch.bincount(batch.long(), minlength=batch_size).cpu()
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int()


def warpconvnet_input(warpconvnet, coordinates: torch.Tensor, features: torch.Tensor,
                      offsets: torch.Tensor | None = None):
    """A new `Voxels` of our int32 `[N, 4]` coordinates (batch index first) and `[N, C]` features, rows in our
    order and no kernel map yet, so a forward on it builds them all. `offsets` is `batch_offsets(coordinates)`,
    computed here (a synchronisation) when not given."""
    if offsets is None:
        offsets = batch_offsets(coordinates)
    # A view, not a copy: WarpConvNet hands its own layers such views (`spatially_sparse_conv`).
    return warpconvnet.Voxels(coordinates[:, 1:], features, offsets=offsets)


def peer_network(warpconvnet, model: nn.Module, coordinates: np.ndarray, features: torch.Tensor, batch_size: int):
    """`model`'s network and weights in WarpConvNet over our int32 `[N, 4]` `coordinates`: (the WarpConvNet model, a
    maker of a fresh input `Voxels`, and a reader of an output's coordinates, ours as they are, and its features).
    The output rows are the input's, in its order (the finest level keeps them), so per-voxel labels line up."""
    warpconvnet_model = build_warpconvnet_network(model.description, warpconvnet).to(
        device=features.device, dtype=next(model.parameters()).dtype)
    copy_weights_to_warpconvnet(model, warpconvnet_model)
    indices = torch.from_numpy(coordinates).to(features.device)
    offsets = batch_offsets(indices, batch_size)

    def output_voxels(output):
        return output.batch_indexed_coordinates, output.features

    return warpconvnet_model, lambda: warpconvnet_input(warpconvnet, indices, features, offsets), output_voxels
