"""`SparseTensor` for PyTorch: torch coordinates and features over the core's kernel-map cache.

The coordinates and features are torch tensors (features carry autograd); a core
`cupysparse.SparseTensor` over zero-copy views of the same memory holds the tensor stride and the
kernel-map cache, so every tensor derived from one input (convolutions, `replace_feature`) shares
the maps built for it and a U-Net's decoder reuses its encoder's maps.

Like spconv's `SparseConvTensor`, a tensor may have a spatial shape (every coordinate in [0, shape)),
which padded convolutions derive their outputs' from, and carries the indice keys its layers registered
(`indice_keys`), which an inverse convolution finds its strided convolution by.
"""

from __future__ import annotations

import functools
import types

import torch

import cupysparse
from cupysparse.geometry.coords import as_tuple
from cupysparse.geometry.kernel_map import MapResult, MapsUnderway
from cupysparse.geometry.sparse_tensor import voxelise

from cupysparse.adapters.torch.bridge import from_core, on_torch_stream, to_core


def _ints(value, dims: int, name: str) -> tuple[int, ...]:
    values = (int(value),) * dims if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != dims:
        raise ValueError(f"{name} must be an int or {dims} ints, got {value!r}")
    return values


def _require_tensor(value, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_on(value: torch.Tensor, device: torch.device, name: str) -> None:
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but points on {device}")


def _reduce_per_voxel(features: torch.Tensor, point_to_voxel: torch.Tensor, num_voxels: int, reduce: str):
    """Per-voxel features `[N, C]` in torch, so autograd reaches the point features: the mean (accumulated in
    float32, float64 for float64 input, as the core does) or the first point's, in input order."""
    if reduce == "first":
        num_points = point_to_voxel.shape[0]
        order = torch.arange(num_points, device=point_to_voxel.device)
        first = order.new_full((num_voxels,), num_points).scatter_reduce(0, point_to_voxel, order, "amin")
        return features[first]
    accumulate = torch.float64 if features.dtype == torch.float64 else torch.float32
    sums = features.new_zeros((num_voxels, features.shape[1]), dtype=accumulate)
    sums = sums.index_add(0, point_to_voxel, features.to(accumulate))
    counts = torch.bincount(point_to_voxel, minlength=num_voxels).to(accumulate)
    return (sums / counts[:, None]).to(features.dtype)


def require_sparse(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a cupysparse.adapters.torch.SparseTensor, got {type(input).__name__}")


_NO_KEYS = types.MappingProxyType({})


class SparseTensor:
    """Sparse voxels in torch: int32 coordinates `[N, 1 + D]` (column 0 the batch index), floating
    features `[N, C]` on the same device, and a tensor stride.

    `validate=False` skips the value checks of the coordinates (range, batch gaps, duplicates),
    which synchronise the GPU; use it only for coordinates the library produced. `spatial_shape` (D positive
    ints, spconv's: each coordinate in [0, shape), checked with the rest) bounds the outputs of padded
    convolutions.
    """

    def __init__(self, coordinates: torch.Tensor, features: torch.Tensor, tensor_stride=1, *, validate=True,
                 spatial_shape=None):
        _require_tensor(coordinates, "coordinates")
        _require_tensor(features, "features")
        if coordinates.device != features.device:
            raise ValueError(f"coordinates are on {coordinates.device} but features on {features.device}")
        if coordinates.dtype != torch.int32:
            raise TypeError(f"coordinates must be int32, got {coordinates.dtype}; use coordinates.int()")
        with on_torch_stream(coordinates.device):  # validation runs kernels: on torch's stream and allocator
            core = cupysparse.SparseTensor(
                to_core(coordinates.contiguous()), to_core(features), tensor_stride, validate=validate,
                spatial_shape=spatial_shape,
            )
        if coordinates.is_cuda:  # the maps' formats, derived at their first use, too
            core.map_cache.derive_in = functools.partial(on_torch_stream, coordinates.device)
        self._set(coordinates, core.coordinates, features, core.tensor_stride, core.map_cache, None, _NO_KEYS)

    def _set(self, coordinates, core_coordinates, features, tensor_stride, map_cache, batch_size,
             indice_keys) -> None:
        self._coordinates = coordinates  # None: the torch view of the core's is made when first asked for
        self._core_coordinates = core_coordinates
        self._features = features
        self._tensor_stride = tensor_stride
        self._map_cache = map_cache
        self._batch_size = batch_size  # None: counted when first asked for (that synchronises the GPU)
        self._indice_keys = indice_keys  # a read-only mapping, shared: a new key makes a new one
        self._core = None

    def with_map_result(self, result: MapResult, features: torch.Tensor) -> SparseTensor:
        """The output of an operation on this tensor over `result`'s map: its coordinates, stride and
        map cache with torch `features`, and this tensor's batch size and indice keys."""
        tensor = SparseTensor.__new__(SparseTensor)
        tensor._set(None, result.out_coordinates, features, result.out_tensor_stride, result.out_map_cache,
                    self._batch_size, self._indice_keys)
        return tensor

    @property
    def indice_keys(self) -> types.MappingProxyType:
        """What the convolutions built with an `indice_key` registered on the way to this tensor, by key
        (spconv's `indice_dict`, read-only): `SparseInverseConv3d` finds its strided convolution there."""
        return self._indice_keys

    def with_indice_key(self, key: str, entry) -> SparseTensor:
        """This tensor with `key` → `entry` added to its indice keys; everything else shared."""
        tensor = SparseTensor.__new__(SparseTensor)
        tensor._set(self._coordinates, self._core_coordinates, self._features, self._tensor_stride, self._map_cache,
                    self._batch_size, types.MappingProxyType({**self._indice_keys, key: entry}))
        return tensor

    @classmethod
    def from_core(cls, tensor: cupysparse.SparseTensor) -> SparseTensor:
        """Zero-copy torch views of a core tensor's arrays, sharing its stride and kernel-map cache (the
        maps already built for it are reused)."""
        if not isinstance(tensor, cupysparse.SparseTensor):
            raise TypeError(f"tensor must be a cupysparse.SparseTensor, got {type(tensor).__name__}")
        result = cls.__new__(cls)
        result._set(None, tensor.coordinates, from_core(tensor.features), tensor.tensor_stride, tensor.map_cache,
                    None, _NO_KEYS)
        return result

    @classmethod
    def collate(cls, coordinates: list[torch.Tensor], features: list[torch.Tensor], tensor_stride=1) -> SparseTensor:
        """One batch from per-item coordinates `[N_b, D]` (no batch column) and features `[N_b, C]`."""
        if len(coordinates) != len(features) or not coordinates:
            raise ValueError(f"need as many feature as coordinate tensors, at least one; got {len(coordinates)} "
                             f"and {len(features)}")
        batched = [
            torch.cat([torch.full((len(c), 1), b, dtype=torch.int32, device=c.device), c.int()], dim=1)
            for b, c in enumerate(coordinates)
        ]
        return cls(torch.cat(batched), torch.cat(features), tensor_stride)

    @classmethod
    def from_points(cls, points: torch.Tensor, voxel_size, batch_index: torch.Tensor | None = None,
                    features: torch.Tensor | None = None, reduce: str = "mean", *, return_index: bool = False):
        """Voxelise float points `[P, D]` on their device as `cupysparse.SparseTensor.from_points` does: one
        row per occupied voxel floor(point / voxel_size), sorted by (batch, c1, …, cD).

        `batch_index` int `[P]` (default all 0); `features` floating `[P, C]` (default ones `[P, 1]`
        float32) reduced per voxel by `reduce` ("mean" or "first"), differentiably. `return_index=True`
        returns `(tensor, point_to_voxel)`, int64 `[P]` the row of each point's voxel (see `point_features`).
        """
        _require_tensor(points, "points")
        for name, value in (("batch_index", batch_index), ("features", features)):
            if value is not None:
                _require_tensor(value, name)
                _require_on(value, points.device, name)
        if reduce not in ("mean", "first"):
            raise ValueError(f"reduce must be one of ('mean', 'first'), got {reduce!r}")
        if features is not None and not features.is_floating_point():
            raise TypeError(f"features must have a floating dtype, got {features.dtype}")
        with on_torch_stream(points.device):  # the core's arrays come from torch's allocator, on its stream
            coordinates, point_to_voxel = voxelise(to_core(points), voxel_size,
                                                   None if batch_index is None else to_core(batch_index))
        coordinates, point_to_voxel = from_core(coordinates), from_core(point_to_voxel)
        num_points = points.shape[0]
        if features is None:
            features = torch.ones((num_points, 1), dtype=torch.float32, device=points.device)
        elif features.dim() != 2 or features.shape[0] != num_points or features.shape[1] < 1:
            raise ValueError(f"features must have shape [{num_points}, C] to match points, got "
                             f"{tuple(features.shape)}")
        voxel_features = _reduce_per_voxel(features, point_to_voxel, coordinates.shape[0], reduce)
        tensor = cls(coordinates, voxel_features, 1, validate=False)
        return (tensor, point_to_voxel) if return_index else tensor

    def point_features(self, point_to_voxel: torch.Tensor) -> torch.Tensor:
        """The features of each point's voxel `[P, C]` (`features[point_to_voxel]`, differentiable): voxel
        outputs back to points, for the index `from_points(..., return_index=True)` gave with these coordinates.

        The range check synchronises a GPU once; `tensor.features[point_to_voxel]` skips it.
        """
        _require_tensor(point_to_voxel, "point_to_voxel")
        if point_to_voxel.device != self.device:
            raise ValueError(f"point_to_voxel is on {point_to_voxel.device} but this tensor is on {self.device}")
        if point_to_voxel.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"point_to_voxel must be int32 or int64, got {point_to_voxel.dtype}")
        if point_to_voxel.dim() != 1:
            raise ValueError(f"point_to_voxel must have shape [P], got {tuple(point_to_voxel.shape)}")
        if point_to_voxel.numel():
            # An index out of range is a device-side assert on the GPU, which ends the CUDA context.
            lowest, highest = torch.stack(torch.aminmax(point_to_voxel)).tolist()
            if lowest < 0 or highest >= self.num_points:
                raise ValueError(
                    f"point_to_voxel holds rows {lowest}..{highest}, outside 0..{self.num_points - 1}: it must be the "
                    "index from_points(..., return_index=True) returned for this tensor's coordinates"
                )
        return self._features.index_select(0, point_to_voxel)

    @property
    def coordinates(self) -> torch.Tensor:
        if self._coordinates is None:
            self._coordinates = from_core(self._core_coordinates)
        return self._coordinates

    @property
    def features(self) -> torch.Tensor:
        return self._features

    @property
    def core(self) -> cupysparse.SparseTensor:
        """The core tensor over the same memory, stride and kernel-map cache (made when first asked for)."""
        if self._core is None:
            self._core = cupysparse.SparseTensor(self._core_coordinates, to_core(self._features), self._tensor_stride,
                                                 validate=False, map_cache=self._map_cache)
        return self._core

    def shares_coordinates(self, other: SparseTensor) -> bool:
        """Whether `other` has this tensor's very coordinates (the same array, as convolutions hand them on),
        not only equal ones; without building either's core tensor."""
        return self._core_coordinates is other._core_coordinates

    @property
    def map_cache(self):
        """The kernel-map cache shared by every tensor derived from the same input."""
        return self._map_cache

    @property
    def tensor_stride(self) -> tuple[int, ...]:
        return self._tensor_stride

    @property
    def spatial_shape(self) -> tuple[int, ...] | None:
        """Every coordinate lies in [0, spatial_shape) (spconv's `spatial_shape`); None when not known."""
        return self._map_cache.spatial_shape(self._tensor_stride)

    @property
    def spatial_dims(self) -> int:
        return self._core_coordinates.shape[1] - 1

    @property
    def num_points(self) -> int:
        return self._core_coordinates.shape[0]

    @property
    def batch_size(self) -> int:
        if self._batch_size is None:
            with on_torch_stream(self.device):  # the tensor's GPU, which need not be the current one
                self._batch_size = int(self._core_coordinates[:, 0].max()) + 1 if self.num_points else 0
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._features.device

    @property
    def dtype(self) -> torch.dtype:
        return self._features.dtype

    def __len__(self) -> int:
        return self.num_points

    def __repr__(self) -> str:
        return (f"SparseTensor(num_points={self.num_points}, channels={self._features.shape[1]}, "
                f"tensor_stride={self.tensor_stride}, dtype={self.dtype}, device={self.device})")

    def kernel_map(self, kernel_size, stride=1, dilation=1, transposed=False, generative=False,
                   padding=None) -> MapResult:
        """The core kernel map (built once per map cache; see `cupysparse.SparseTensor.kernel_map`), built on
        torch's stream and allocator."""
        arguments = (self._tensor_stride, kernel_size, stride, dilation, transposed, generative, padding)
        result = self._map_cache.lookup(*arguments)
        if result is None:
            with on_torch_stream(self.device):
                result = self._map_cache.kernel_map(*arguments)
        return result

    def downsample_to(self, tensor_strides) -> None:
        """`KernelMapCache.downsample_to` on torch's stream and allocator: the coordinates at each of
        `tensor_strides`, computed now with one synchronisation, for the strided convolutions that
        reach them later."""
        with on_torch_stream(self.device):
            self._map_cache.downsample_to(tensor_strides)

    def build_maps(self, requests, with_reversed: bool = False) -> list[MapResult]:
        """`KernelMapCache.build_maps` on torch's stream and allocator: the maps of `requests`, built now for a
        whole network at once, which its layers then find built."""
        with on_torch_stream(self.device):
            return self._map_cache.build_maps(requests, with_reversed)

    def start_maps(self, requests, with_reversed: bool = False) -> MapsUnderway:
        """`KernelMapCache.start_maps` on torch's stream and allocator (its second step too): `build_maps` in two
        steps, the second when a layer first asks for a map the first did not build."""
        with on_torch_stream(self.device):
            return self._map_cache.start_maps(requests, with_reversed)

    def replace_feature(self, features: torch.Tensor) -> SparseTensor:
        """The same coordinates, stride and map cache with new features `[N, C']`."""
        _require_tensor(features, "features")
        if features.device != self.device:
            raise ValueError(f"features are on {features.device} but this tensor is on {self.device}")
        if features.dim() != 2 or features.shape[0] != self.num_points or features.shape[1] < 1:
            raise ValueError(f"features must have shape [{self.num_points}, C], got {tuple(features.shape)}")
        tensor = SparseTensor.__new__(SparseTensor)
        tensor._set(self._coordinates, self._core_coordinates, features, self._tensor_stride, self._map_cache,
                    self._batch_size, self._indice_keys)
        return tensor

    replace_features = replace_feature

    def decompose(self) -> list[torch.Tensor]:
        """The features of each batch item, in batch order (rows keep their order)."""
        batch = self.coordinates[:, 0].long()
        return [self._features[batch == b] for b in range(self.batch_size)]

    def to_dense(self, origin=None, shape=None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Scatter into a dense `[B, C, *shape]` tensor, differentiable in the features; returns
        `(dense, origin)`. Dense index `i` along axis `d` holds coordinate `origin[d] + i`; `origin`
        defaults to the per-axis minimum and `shape` to what reaches the maximum."""
        dims = self.spatial_dims
        spatial = self.coordinates[:, 1:].long()
        if self.num_points:
            lows, highs = spatial.min(0).values.tolist(), spatial.max(0).values.tolist()
        else:
            lows, highs = [0] * dims, [-1] * dims
        origin = tuple(lows) if origin is None else _ints(origin, dims, "origin")
        shape = tuple(h - o + 1 for h, o in zip(highs, origin)) if shape is None else as_tuple(shape, dims, "shape")
        for axis in range(dims):
            if self.num_points and (lows[axis] < origin[axis] or highs[axis] >= origin[axis] + shape[axis]):
                raise ValueError(f"voxels span [{lows[axis]}, {highs[axis]}] along axis {axis}, outside the dense "
                                 f"box origin={origin}, shape={shape}")
        dense = self._features.new_zeros((self.batch_size, *shape, self._features.shape[1]))
        index = (self.coordinates[:, 0].long(), *(spatial - torch.tensor(origin, device=self.device)).unbind(1))
        dense = dense.index_put(index, self._features)
        return dense.permute(0, dims + 1, *range(1, dims + 1)), origin
