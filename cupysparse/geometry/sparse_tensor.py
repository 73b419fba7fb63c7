"""`SparseTensor`: voxel coordinates, their features, the tensor stride and a cache of kernel maps.

Coordinates are int32 `[N, 1 + D]` (column 0 the batch index, then D = 2..4 spatial coordinates in
units of the tensor's own stride); features are floating `[N, C]`. Both arrays are NumPy (CPU) or
both CuPy (GPU). The kernel-map cache travels with the coordinates, so tensors that share
coordinates (e.g. the output of `replace_features`) share the maps built for them. An optional
spatial shape (spconv's: every coordinate in [0, shape)) bounds the outputs of padded convolutions.

`SparseTensor.from_points` voxelises float points, optionally returning each point's voxel row
(`point_to_voxel`), and `point_features` gathers voxel features back to the points; `voxelise` is the
same voxelisation without features, for the frameworks' own `from_points`.
"""

from __future__ import annotations

import numpy as np

from cupysparse.cuda.backend import all_true, array_module, is_cupy_array, to_device, to_numpy
from cupysparse.geometry.coords import (
    MAX_SPATIAL_DIMS,
    as_tuple,
    is_integer,
    check_coordinate_layout,
    key_layout,
    pack_keys,
    unpack_keys,
    validate_coordinates,
)
from cupysparse.geometry.kernel_map import KernelMapCache, MapResult

_REDUCTIONS = ("mean", "first")


def _backend_name(array) -> str:
    return "CuPy" if is_cupy_array(array) else "NumPy"


def _require_array(array, name: str) -> None:
    if not (isinstance(array, np.ndarray) or is_cupy_array(array)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")


def _require_same_backend(*named_arrays) -> None:
    """Raise TypeError unless every (name, array) pair lives on the same backend as the first."""
    first_name, first_array = named_arrays[0]
    for name, array in named_arrays[1:]:
        if is_cupy_array(array) != is_cupy_array(first_array):
            raise TypeError(
                f"{first_name} and {name} must both be NumPy or both be CuPy arrays, got "
                f"{_backend_name(first_array)} {first_name} and {_backend_name(array)} {name}"
            )


def _is_floating(dtype) -> bool:
    # bfloat16 (ml_dtypes on NumPy) is not a NumPy floating subtype, so it is recognised by name.
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _check_features(features, num_rows: int, rows_owner: str) -> None:
    """Dtype and shape checks only: none of them reads values, so none synchronises the GPU."""
    _require_array(features, "features")
    if not _is_floating(features.dtype):
        raise TypeError(f"features must have a floating dtype (float16, bfloat16, float32, float64), got {features.dtype}")
    if features.ndim != 2:
        raise ValueError(f"features must have shape [N, C], got {tuple(features.shape)}")
    if features.shape[0] != num_rows:
        raise ValueError(f"features has {features.shape[0]} rows but {rows_owner} has {num_rows}")
    if features.shape[1] < 1:
        raise ValueError(f"features must have at least one channel, got shape {tuple(features.shape)}")


def _check_coordinates(coordinates, validate: bool) -> None:
    if validate:
        validate_coordinates(coordinates, "coordinates")
    else:
        check_coordinate_layout(coordinates, "coordinates")  # the value checks would synchronise the GPU


def _check_spatial_shape(coordinates, spatial_shape, validate: bool) -> tuple[int, ...]:
    """`spatial_shape` as D positive ints; with `validate`, every coordinate inside [0, shape) (on the GPU
    this synchronises)."""
    shape = as_tuple(spatial_shape, coordinates.shape[1] - 1, "spatial_shape")
    if validate and coordinates.shape[0]:
        lows = to_numpy(coordinates[:, 1:].min(axis=0))
        highs = to_numpy(coordinates[:, 1:].max(axis=0))
        for axis, (low, high, size) in enumerate(zip(lows, highs, shape)):
            if low < 0 or high >= size:
                raise ValueError(f"coordinates: axis {axis} spans [{int(low)}, {int(high)}], outside the spatial "
                                 f"shape {shape} (each coordinate in [0, size))")
    return shape


class SparseTensor:
    """Sparse voxels: int32 coordinates `[N, 1 + D]`, floating features `[N, C]`, a tensor stride.

    `validate=False` skips the value checks of the coordinates (range, batch gaps, duplicates),
    which synchronise the GPU; use it only for coordinates the library produced itself. Dtype and
    shape checks always run. `map_cache` (a `KernelMapCache`) is shared by the tensors derived
    from one another, so each kernel map is built once. `spatial_shape` (D positive ints, spconv's
    `spatial_shape`: each coordinate in [0, shape)) starts a new cache with it; the tensors derived
    from this one get theirs from the cache (`KernelMapCache.spatial_shape`).
    """

    def __init__(self, coordinates, features, tensor_stride=1, *, validate=True, map_cache=None,
                 spatial_shape=None):
        _require_array(coordinates, "coordinates")
        _require_array(features, "features")
        _require_same_backend(("coordinates", coordinates), ("features", features))
        _check_coordinates(coordinates, validate)
        _check_features(features, coordinates.shape[0], "coordinates")
        if spatial_shape is not None:
            if map_cache is not None:
                raise ValueError("pass spatial_shape or map_cache, not both: a map cache has its spatial shape")
            spatial_shape = _check_spatial_shape(coordinates, spatial_shape, validate)
        self._coordinates = coordinates
        self._features = features
        self._tensor_stride = as_tuple(tensor_stride, coordinates.shape[1] - 1, "tensor_stride")
        if map_cache is None:
            map_cache = KernelMapCache(coordinates, self._tensor_stride, spatial_shape=spatial_shape)
        self._map_cache = map_cache
        self._batch_size = None

    @property
    def coordinates(self):
        return self._coordinates

    @property
    def features(self):
        return self._features

    @property
    def tensor_stride(self) -> tuple[int, ...]:
        return self._tensor_stride

    @property
    def spatial_dims(self) -> int:
        return self._coordinates.shape[1] - 1

    @property
    def num_points(self) -> int:
        return self._coordinates.shape[0]

    def __len__(self) -> int:
        return self.num_points

    @property
    def num_channels(self) -> int:
        return self._features.shape[1]

    @property
    def dtype(self):
        return self._features.dtype

    @property
    def device(self) -> str:
        return "cuda" if is_cupy_array(self._coordinates) else "cpu"

    @property
    def batch_size(self) -> int:
        """Largest batch index + 1 (0 when empty). Memoised: on the GPU it synchronises."""
        if self._batch_size is None:
            self._batch_size = int(self._coordinates[:, 0].max()) + 1 if self.num_points else 0
        return self._batch_size

    @property
    def map_cache(self):
        return self._map_cache

    @property
    def spatial_shape(self) -> tuple[int, ...] | None:
        """Every coordinate lies in [0, spatial_shape) (spconv's `spatial_shape`); None when not known."""
        return self._map_cache.spatial_shape(self._tensor_stride)

    def kernel_map(self, kernel_size, stride=1, dilation=1, transposed=False, generative=False,
                   padding=None) -> MapResult:
        """The kernel map of a convolution applied to this tensor, built once and cached.

        See `cupysparse.geometry.kernel_map` for the semantics of each kind, and `padding` for spconv's
        (`padding` not None). The result also carries the output coordinates and tensor stride, and the map
        cache the output tensor should share.
        """
        return self._map_cache.kernel_map(self._tensor_stride, kernel_size, stride, dilation, transposed, generative,
                                          padding)

    def __repr__(self) -> str:
        return (
            f"SparseTensor(num_points={self.num_points}, num_channels={self.num_channels}, "
            f"spatial_dims={self.spatial_dims}, tensor_stride={self.tensor_stride}, "
            f"dtype={self.dtype}, device={self.device!r})"
        )

    def _with_arrays(self, coordinates, features, map_cache, spatial_shape=None) -> SparseTensor:
        """A tensor over already-validated coordinates; the batch size carries over unchanged."""
        tensor = SparseTensor(coordinates, features, self._tensor_stride, validate=False, map_cache=map_cache,
                              spatial_shape=spatial_shape)
        tensor._batch_size = self._batch_size
        return tensor

    def replace_features(self, features) -> SparseTensor:
        """The same coordinates, stride and map cache with new features `[N, C']`."""
        return self._with_arrays(self._coordinates, features, self._map_cache)

    def to(self, device: str) -> SparseTensor:
        """This tensor on 'cpu' (NumPy) or 'cuda' (CuPy); self when already there."""
        if device == self.device:
            return self
        coordinates = to_device(self._coordinates, device)
        features = to_device(self._features, device)
        # Kernel maps hold arrays of the old device, so the moved tensor starts a fresh cache.
        return self._with_arrays(coordinates, features, None, self.spatial_shape)

    def to_dense(self, origin=None, shape=None):
        """Scatter into a dense `[B, C, *shape]` array; return `(dense, origin)`.

        Dense index `i` along spatial axis `d` holds coordinate `origin[d] + i` (in units of the
        tensor stride); cells with no voxel are zero. `origin` defaults to the per-axis minimum
        coordinate and `shape` to what reaches the per-axis maximum; voxels outside a given
        origin/shape raise ValueError.
        """
        xp = array_module(self._coordinates)
        dims = self.spatial_dims
        spatial = self._coordinates[:, 1:].astype(np.int64)
        if self.num_points:
            lows = tuple(to_numpy(spatial.min(axis=0)).tolist())
            highs = tuple(to_numpy(spatial.max(axis=0)).tolist())
        else:
            lows, highs = (0,) * dims, (-1,) * dims
        origin = lows if origin is None else _int_tuple(origin, dims, "origin")
        if shape is None:
            shape = tuple(max(high - low + 1, 0) for high, low in zip(highs, origin))
        else:
            shape = as_tuple(shape, dims, "shape")
        if self.num_points:
            for axis in range(dims):
                if lows[axis] < origin[axis] or highs[axis] >= origin[axis] + shape[axis]:
                    raise ValueError(
                        f"voxels span [{lows[axis]}, {highs[axis]}] along axis {axis}, outside the dense box "
                        f"origin={origin}, shape={shape}"
                    )
        # Flatten the spatial index so one advanced-index assignment fills every voxel.
        flat_index = xp.zeros(self.num_points, dtype=np.int64)
        for axis in range(dims):
            flat_index = flat_index * shape[axis] + (spatial[:, axis] - origin[axis])
        volume = int(np.prod(shape))
        dense = xp.zeros((self.batch_size, self.num_channels, volume), dtype=self.dtype)
        dense.transpose(0, 2, 1)[self._coordinates[:, 0], flat_index] = self._features
        return dense.reshape((self.batch_size, self.num_channels) + shape), origin

    def point_features(self, point_to_voxel):
        """The features of each point's voxel, `features[point_to_voxel]` `[P, C]`: voxel outputs back to points.

        `point_to_voxel` is the index `from_points(..., return_index=True)` returned for these
        coordinates (the output of a submanifold network keeps them). On the GPU the range check synchronises.
        """
        _require_array(point_to_voxel, "point_to_voxel")
        _require_same_backend(("features", self._features), ("point_to_voxel", point_to_voxel))
        if not np.issubdtype(point_to_voxel.dtype, np.integer):
            raise TypeError(f"point_to_voxel must have an integer dtype, got {point_to_voxel.dtype}")
        if point_to_voxel.ndim != 1:
            raise ValueError(f"point_to_voxel must have shape [P], got {tuple(point_to_voxel.shape)}")
        # CuPy does not bounds-check gathers: an index from other coordinates would read wrong rows silently.
        if not all_true((point_to_voxel >= 0) & (point_to_voxel < self.num_points)):
            raise ValueError(
                f"point_to_voxel holds rows outside 0..{self.num_points - 1}: it must be the index "
                "from_points(..., return_index=True) returned for this tensor's coordinates"
            )
        return self._features[point_to_voxel]

    @classmethod
    def from_points(cls, points, voxel_size, batch_index=None, features=None, reduce="mean", device=None, *,
                    return_index=False):
        """Voxelise float points `[P, D]`: voxel = floor(point / voxel_size), one row per occupied voxel.

        `batch_index` int `[P]` (default all 0); `features` floating `[P, C]` (default ones `[P, 1]`
        float32) reduced per voxel by `reduce`: "mean", or "first" (the first point in input order).
        Rows come sorted by (batch, c1, …, cD). `device=None` keeps the backend of `points`.
        `return_index=True` returns `(tensor, point_to_voxel)`, point_to_voxel int64 `[P]` the row of
        each point's voxel (see `voxelise` and `point_features`).
        """
        layout, voxel_sizes = _check_point_arguments(points, voxel_size, batch_index)
        num_points = points.shape[0]
        if reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        if features is not None:
            _check_features(features, num_points, "points")

        if device is not None:
            points = to_device(points, device)
            batch_index = None if batch_index is None else to_device(batch_index, device)
            features = None if features is None else to_device(features, device)
        optional = (("batch_index", batch_index), ("features", features))
        _require_same_backend(("points", points), *((name, array) for name, array in optional if array is not None))
        if features is None:
            features = array_module(points).ones((num_points, 1), dtype=np.float32)

        coordinates, point_to_voxel = _voxelise_checked(points, voxel_sizes, layout, batch_index)
        num_voxels = coordinates.shape[0]
        if reduce == "mean":
            voxel_features = _scatter_mean(features, point_to_voxel, num_voxels)
        else:
            voxel_features = features[_first_point_of_each_voxel(point_to_voxel, num_voxels)]
        tensor = cls(coordinates, voxel_features, 1, validate=False)
        return (tensor, point_to_voxel) if return_index else tensor


def voxelise(points, voxel_size, batch_index=None):
    """The voxels of float points `[P, D]`, without features: `(coordinates, point_to_voxel)`.

    `coordinates` int32 `[N, 1 + D]`: each occupied voxel floor(point / voxel_size) once, its batch
    index (`batch_index` int `[P]`, default all 0) in column 0, sorted by (batch, c1, …, cD), as
    `SparseTensor.from_points` gives them. `point_to_voxel` int64 `[P]`: the row of each point's
    voxel. The frameworks' `from_points` reduce their own features over it, keeping autograd.
    """
    layout, voxel_sizes = _check_point_arguments(points, voxel_size, batch_index)
    if batch_index is not None:
        _require_same_backend(("points", points), ("batch_index", batch_index))
    return _voxelise_checked(points, voxel_sizes, layout, batch_index)


def _check_point_arguments(points, voxel_size, batch_index):
    """Dtype and shape checks of the points, voxel size and batch index; returns (key layout, voxel sizes `[D]`)."""
    _require_array(points, "points")
    if not _is_floating(points.dtype):
        raise TypeError(f"points must have a floating dtype, got {points.dtype}")
    if points.ndim != 2 or not 2 <= points.shape[1] <= MAX_SPATIAL_DIMS:
        raise ValueError(f"points must have shape [P, D] with D = 2..{MAX_SPATIAL_DIMS}, got {tuple(points.shape)}")
    layout = key_layout(points.shape[1])
    voxel_sizes = _voxel_sizes(voxel_size, layout.spatial_dims)
    if batch_index is not None:
        _require_array(batch_index, "batch_index")
        if not np.issubdtype(batch_index.dtype, np.integer):
            raise TypeError(f"batch_index must have an integer dtype, got {batch_index.dtype}")
        num_points = points.shape[0]
        if batch_index.shape != (num_points,):
            raise ValueError(
                f"batch_index must have shape ({num_points},) to match points, got {tuple(batch_index.shape)}"
            )
    return layout, voxel_sizes


def _voxelise_checked(points, voxel_sizes, layout, batch_index):
    """`voxelise` after the dtype, shape and backend checks: the value checks (they synchronise the GPU), then
    the voxels."""
    xp = array_module(points)
    dims, num_points = layout.spatial_dims, points.shape[0]
    finite = xp.isfinite(points)
    if not all_true(finite):
        row = int(xp.flatnonzero(~finite.all(axis=1))[0])
        point = to_numpy(points[row]).tolist()
        raise ValueError(f"points must be finite (got NaN or infinity): point {row} is {point}")
    # float64 so float16/float32 points floor exactly as the same values divided in Python would.
    scaled = xp.floor(points.astype(np.float64) / xp.asarray(voxel_sizes))
    if num_points:
        low, high = float(scaled.min()), float(scaled.max())
        if low < layout.coord_min or high > layout.coord_max:
            outside = (scaled < layout.coord_min) | (scaled > layout.coord_max)
            row = int(xp.flatnonzero(outside.any(axis=1))[0])
            raise ValueError(
                f"points / voxel_size give voxel coordinates in [{low:.0f}, {high:.0f}], outside "
                f"[{layout.coord_min}, {layout.coord_max}] for D = {dims} (first: point {row}, "
                f"{to_numpy(points[row]).tolist()}): use a larger voxel_size or shift the points"
            )
        if batch_index is not None:
            lowest_batch, highest_batch = int(batch_index.min()), int(batch_index.max())
            if lowest_batch < 0:
                raise ValueError(f"batch_index must be non-negative, got {lowest_batch}")
            if highest_batch > layout.batch_max:
                raise ValueError(f"batch_index {highest_batch} exceeds {layout.batch_max} for D = {dims}")

    point_voxels = xp.empty((num_points, 1 + dims), dtype=np.int32)
    point_voxels[:, 0] = 0 if batch_index is None else batch_index
    point_voxels[:, 1:] = scaled.astype(np.int32)
    unique_keys, point_to_voxel = xp.unique(pack_keys(point_voxels), return_inverse=True)
    coordinates = unpack_keys(unique_keys, dims)
    # Ranges were checked above; this catches batch indices with no points between used ones.
    validate_coordinates(coordinates, "batch_index (voxelised coordinates)")
    return coordinates, point_to_voxel.astype(np.int64, copy=False)


def _voxel_sizes(voxel_size, dims: int) -> np.ndarray:
    """Broadcast a positive scalar or D positive floats to a float64 array `[D]`."""
    try:
        values = np.asarray(voxel_size, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"voxel_size must be a number or {dims} numbers, got {voxel_size!r}") from None
    if values.ndim > 1 or values.size not in (1, dims):
        raise ValueError(f"voxel_size must be a number or {dims} numbers, got {voxel_size!r}")
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"voxel_size must be finite and positive, got {voxel_size!r}")
    return np.broadcast_to(values.reshape(-1), (dims,)).copy()


def _int_tuple(value, dims: int, name: str) -> tuple[int, ...]:
    """`dims` ints of any sign (`as_tuple` takes sizes, which are positive); a bool is no int here either."""
    values = tuple(value) if np.ndim(value) == 1 else ()
    if len(values) != dims or not all(is_integer(v) for v in values):
        raise ValueError(f"{name} must be {dims} ints, got {value!r}")
    return tuple(int(v) for v in values)


def _scatter_mean(features, point_to_voxel, num_voxels: int):
    """Per-voxel mean of the feature rows, accumulated in float32 (float64 for float64 input)."""
    xp = array_module(features)
    accumulate_dtype = np.float64 if features.dtype == np.float64 else np.float32
    sums = xp.zeros((num_voxels, features.shape[1]), dtype=accumulate_dtype)
    # ufunc.at works on both backends (CuPy ≥ 12; cupyx.scatter_add is deprecated in its favour).
    xp.add.at(sums, point_to_voxel, features.astype(accumulate_dtype))
    counts = xp.bincount(point_to_voxel, minlength=num_voxels).astype(accumulate_dtype)
    return (sums / counts[:, None]).astype(features.dtype)


def _first_point_of_each_voxel(point_to_voxel, num_voxels: int):
    """Index of the lowest-numbered point in each voxel."""
    xp = array_module(point_to_voxel)
    # uint64: CuPy's minimum.at has no int64 variant. Every voxel has a point, so the initial
    # value P is always replaced.
    num_points = point_to_voxel.shape[0]
    first = xp.full(num_voxels, num_points, dtype=np.uint64)
    xp.minimum.at(first, point_to_voxel, xp.arange(num_points, dtype=np.uint64))
    return first.astype(np.int64)
