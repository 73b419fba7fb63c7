"""`SparseTensor` for JAX: features (a JAX array, traced under `jit`) on a static `Geometry`.

The geometry (coordinates, tensor stride and the core's kernel-map cache) is the pytree's auxiliary
data, so `jit` treats it as static: kernel maps are built in Python while tracing, from concrete
coordinates, and only the features flow through the compiled computation. Sizes depend on the
coordinates, so a new geometry means a new trace; tensors derived from one another share a cache,
so a U-Net builds each map once and its decoder reuses the encoder's maps.

Coordinates live where the features live: NumPy for features on a CPU device, CuPy for features
on a GPU (JAX arrays cross to CuPy through DLPack, without a copy).

`SparseTensor.from_points` voxelises concrete points with the core's `voxelise` (the geometry) and reduces
the point features per voxel in `jax.numpy` (so they may be traced and differentiated); `point_features`
gathers voxel features back to the points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cupysparse.cuda.backend import cupy_module, gpu_available, is_cupy_array, to_device, to_numpy
from cupysparse.geometry.coords import as_tuple, validate_coordinates
from cupysparse.cuda.dtypes import FEATURE_DTYPES, accumulation_dtype
from cupysparse.geometry.kernel_map import KernelMapCache
from cupysparse.geometry.sparse_tensor import voxelise

_GPU_PLATFORMS = ("gpu", "cuda")
_REDUCTIONS = ("mean", "first")


class Geometry:
    """The coordinates at one tensor stride of a `KernelMapCache`.

    Two geometries are equal when they share the cache and the stride, which is what lets `jit`
    reuse a trace for tensors on the same coordinates.
    """

    def __init__(self, map_cache: KernelMapCache, tensor_stride: tuple[int, ...]):
        self.map_cache = map_cache
        self.tensor_stride = tuple(tensor_stride)

    @classmethod
    def from_coordinates(cls, coordinates, tensor_stride=1, device: str = "cpu") -> Geometry:
        """Validated int32 coordinates `[N, 1 + D]` (NumPy, CuPy or JAX) moved to `device`."""
        coords = _core_array(coordinates, "coordinates", device)
        validate_coordinates(coords, "coordinates")
        stride = as_tuple(tensor_stride, coords.shape[1] - 1, "tensor_stride")
        return cls(KernelMapCache(coords, stride), stride)

    @property
    def coordinates(self):
        """int32 `[N, 1 + D]`, NumPy or CuPy."""
        return self.map_cache.coordinates(self.tensor_stride)

    @property
    def device(self) -> str:
        return "cuda" if is_cupy_array(self.coordinates) else "cpu"

    @property
    def num_points(self) -> int:
        return self.coordinates.shape[0]

    def kernel_map(self, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """(core `KernelMap`, output `Geometry`) of a convolution on these coordinates, built once."""
        result = self.map_cache.kernel_map(self.tensor_stride, kernel_size, stride, dilation, transposed, generative)
        return result.kernel_map, Geometry(result.out_map_cache, result.out_tensor_stride)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Geometry)
            and other.map_cache is self.map_cache
            and other.tensor_stride == self.tensor_stride
        )

    def __hash__(self) -> int:
        return hash((id(self.map_cache), self.tensor_stride))

    def __repr__(self) -> str:
        return f"Geometry(num_points={self.num_points}, tensor_stride={self.tensor_stride}, device={self.device!r})"


def _core_array(array, name: str, device: str):
    """A concrete NumPy, CuPy or JAX array as the core's array on `device` (NumPy for 'cpu', CuPy for 'cuda')."""
    if isinstance(array, jax.core.Tracer):
        raise TypeError(f"{name} must be concrete: build sparse tensors outside jit and pass them in")
    if isinstance(array, jax.Array):
        if device == "cuda" and _platform(array) in _GPU_PLATFORMS:
            return cupy_module().from_dlpack(array)
        array = np.asarray(array)
    if not (isinstance(array, np.ndarray) or is_cupy_array(array)):
        raise TypeError(f"{name} must be a NumPy, CuPy or JAX array, got {type(array).__name__}")
    return to_device(array, device)


def _platform(array: jax.Array) -> str:
    return next(iter(array.devices())).platform


def _device_of(features) -> str:
    """'cuda' for features on a GPU, 'cpu' otherwise; the maps are built there."""
    if isinstance(features, jax.core.Tracer):
        raise TypeError(
            "features is traced: build the SparseTensor outside jit, then pass it in (it is a pytree) "
            "or call replace_features inside"
        )
    if _platform(features) not in _GPU_PLATFORMS:
        return "cpu"
    if not gpu_available():
        raise RuntimeError("features are on a JAX GPU but CuPy sees no CUDA GPU (see `python -m cupysparse info`)")
    return "cuda"


def _placement_of_points(points) -> tuple[str, jax.Device]:
    """Where concrete points voxelise ('cuda' or 'cpu', the core's backend) and the JAX device that gets the
    tensor's features and the index: a JAX array's own device, JAX's CPU for NumPy points."""
    if isinstance(points, jax.core.Tracer):
        raise TypeError("points must be concrete: voxelise outside jit (or close over the points), then pass the "
                        "tensor in")
    if isinstance(points, np.ndarray):
        return "cpu", jax.devices("cpu")[0]
    if not isinstance(points, jax.Array):
        raise TypeError(f"points must be a JAX or NumPy array, got {type(points).__name__}")
    return ("cuda" if _platform(points) in _GPU_PLATFORMS else "cpu"), next(iter(points.devices()))


def _point_features_on(features, num_points: int, jax_device: jax.Device):
    """Checked features `[P, C]` (ones `[P, 1]` float32 by default) on the points' JAX device; traced ones pass
    through, since only their dtype and shape can be checked."""
    if features is None:
        return jax.device_put(np.ones((num_points, 1), np.float32), jax_device)
    if isinstance(features, np.ndarray):
        features = jax.device_put(features, jax_device)
    check_features(features, num_points)
    if features.shape[1] < 1:
        raise ValueError(f"features must have at least one channel, got shape {tuple(features.shape)}")
    if not isinstance(features, jax.core.Tracer) and features.devices() != {jax_device}:
        raise ValueError(f"features are on {features.devices()} but points on {jax_device}: put both on one device "
                         "(jax.device_put)")
    return features


def _reduce_per_voxel(features, point_to_voxel, num_voxels: int, reduce: str):
    """Per-voxel features `[N, C]` in `jax.numpy`, so `jax.grad` reaches the point features: the mean (accumulated
    in float32, float64 for float64 input, as the core does) or the first point's, in input order."""
    if reduce == "first":
        order = jnp.arange(point_to_voxel.shape[0], dtype=point_to_voxel.dtype)
        first = jax.ops.segment_min(order, point_to_voxel, num_segments=num_voxels)
        return features[first]
    wide = accumulation_dtype(features.dtype)
    sums = jax.ops.segment_sum(features.astype(wide), point_to_voxel, num_segments=num_voxels)
    counts = jnp.bincount(point_to_voxel, length=num_voxels).astype(wide)
    return (sums / counts[:, None]).astype(features.dtype)


def check_features(features, num_rows: int) -> None:
    """Dtype and shape checks on a JAX array or tracer (nothing reads its values)."""
    if not isinstance(features, jax.Array):
        raise TypeError(f"features must be a JAX array, got {type(features).__name__}")
    if features.dtype not in FEATURE_DTYPES:
        raise TypeError(f"features must be float64, float32, float16 or bfloat16, got {features.dtype}")
    if features.ndim != 2 or features.shape[0] != num_rows:
        raise ValueError(f"features must have shape [{num_rows}, C], got {tuple(features.shape)}")


@jax.tree_util.register_pytree_node_class
class SparseTensor:
    """Features `[N, C]` (a JAX array) on int32 coordinates `[N, 1 + D]` at a tensor stride.

    `SparseTensor(coordinates, features, tensor_stride=1)` validates the coordinates (range, batch
    gaps, duplicates) and must run outside `jit`; inside, derive tensors with `replace_features`
    and the convolutions.
    """

    def __init__(self, coordinates, features, tensor_stride=1):
        if isinstance(features, np.ndarray):
            features = jax.numpy.asarray(features)
        if not isinstance(features, jax.Array):
            raise TypeError(f"features must be a JAX array, got {type(features).__name__}")
        geometry = Geometry.from_coordinates(coordinates, tensor_stride, _device_of(features))
        check_features(features, geometry.num_points)
        self._features = features
        self._geometry = geometry

    @classmethod
    def on(cls, geometry: Geometry, features) -> SparseTensor:
        """A tensor on an existing geometry; works on traced features."""
        check_features(features, geometry.num_points)
        return cls.tree_unflatten(geometry, (features,))

    @classmethod
    def from_points(cls, points, voxel_size, batch_index=None, features=None, reduce: str = "mean", *,
                    return_index: bool = False):
        """Voxelise float points `[P, D]` as `cupysparse.SparseTensor.from_points` does: one row per occupied
        voxel floor(point / voxel_size), sorted by (batch, c1, …, cD).

        `points` and `batch_index` (int `[P]`, default all 0) are concrete JAX or NumPy arrays (closed-over
        arrays are concrete inside `jit`): they make the geometry. The tensor lives on the points' JAX device
        (NumPy points: the CPU). `features` floating `[P, C]` (default ones `[P, 1]` float32) may be traced:
        they are reduced per voxel by `reduce` ("mean" or "first") in `jax.numpy`, differentiably.
        `return_index=True` returns `(tensor, point_to_voxel)`, the row of each point's voxel `[P]` in JAX's
        default integer dtype (int32; int64 under `jax_enable_x64`); see `point_features`.
        """
        if reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        device, jax_device = _placement_of_points(points)
        core_points = _core_array(points, "points", device)
        core_batch_index = None if batch_index is None else _core_array(batch_index, "batch_index", device)
        coordinates, core_point_to_voxel = voxelise(core_points, voxel_size, core_batch_index)
        features = _point_features_on(features, core_points.shape[0], jax_device)
        # The voxelisation has synchronised already; P ints through the host keep this device-agnostic.
        index_dtype = jax.dtypes.canonicalize_dtype(np.int64)
        point_to_voxel = jax.device_put(to_numpy(core_point_to_voxel).astype(index_dtype), jax_device)
        voxel_features = _reduce_per_voxel(features, point_to_voxel, coordinates.shape[0], reduce)
        stride = (1,) * (coordinates.shape[1] - 1)
        tensor = cls.on(Geometry(KernelMapCache(coordinates, stride), stride), voxel_features)
        return (tensor, point_to_voxel) if return_index else tensor

    def point_features(self, point_to_voxel):
        """The features of each point's voxel `[P, C]` (`features[point_to_voxel]`, differentiable): voxel
        outputs back to points, for the index `from_points(..., return_index=True)` gave with these coordinates.

        A concrete index is range-checked (a GPU one is copied to the host for it); a traced one cannot be.
        """
        if not isinstance(point_to_voxel, (jax.Array, np.ndarray)):
            raise TypeError(f"point_to_voxel must be a JAX or NumPy array, got {type(point_to_voxel).__name__}")
        if not jnp.issubdtype(point_to_voxel.dtype, jnp.integer):
            raise TypeError(f"point_to_voxel must have an integer dtype, got {point_to_voxel.dtype}")
        if point_to_voxel.ndim != 1:
            raise ValueError(f"point_to_voxel must have shape [P], got {tuple(point_to_voxel.shape)}")
        if not isinstance(point_to_voxel, jax.core.Tracer) and point_to_voxel.size:
            # NumPy, not jnp: inside a jit trace jnp would stage even a concrete array's min and max.
            index = np.asarray(point_to_voxel)
            lowest, highest = int(index.min()), int(index.max())
            if lowest < 0 or highest >= self.num_points:
                raise ValueError(
                    f"point_to_voxel holds rows {lowest}..{highest}, outside 0..{self.num_points - 1}: it must be the "
                    "index from_points(..., return_index=True) returned for this tensor's coordinates"
                )
        # JAX clamps (and wraps negative) gather indices silently: a traced index from other coordinates reads
        # NaN rows instead of another voxel's features.
        rows = jnp.where(point_to_voxel < 0, self.num_points, point_to_voxel)
        return jnp.take(self._features, rows, axis=0, mode="fill", fill_value=jnp.nan)

    @property
    def features(self):
        return self._features

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    @property
    def coordinates(self):
        """int32 `[N, 1 + D]`: NumPy for CPU features, CuPy for GPU features."""
        return self._geometry.coordinates

    @property
    def tensor_stride(self) -> tuple[int, ...]:
        return self._geometry.tensor_stride

    @property
    def num_points(self) -> int:
        return self._geometry.num_points

    @property
    def num_channels(self) -> int:
        return self._features.shape[1]

    @property
    def dtype(self):
        return self._features.dtype

    def kernel_map(self, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """(core `KernelMap`, output `Geometry`); see `Geometry.kernel_map`."""
        return self._geometry.kernel_map(kernel_size, stride, dilation, transposed, generative)

    def replace_features(self, features) -> SparseTensor:
        """The same geometry with new features `[N, C']`."""
        return SparseTensor.on(self._geometry, features)

    def tree_flatten(self):
        return (self._features,), self._geometry

    @classmethod
    def tree_unflatten(cls, geometry, children):
        # No checks: JAX rebuilds pytrees with placeholder leaves during its transformations.
        tensor = object.__new__(cls)
        (tensor._features,) = children
        tensor._geometry = geometry
        return tensor

    def __repr__(self) -> str:
        return (
            f"SparseTensor(num_points={self.num_points}, num_channels={self.num_channels}, "
            f"tensor_stride={self.tensor_stride}, dtype={self.dtype}, device={self._geometry.device!r})"
        )


def cat(*tensors: SparseTensor) -> SparseTensor:
    """Features concatenated along channels, for tensors on one geometry (a U-Net's skip connection)."""
    if not tensors or not all(isinstance(t, SparseTensor) for t in tensors):
        raise TypeError("cat expects one or more SparseTensors")
    geometry = tensors[0].geometry
    if any(t.geometry != geometry for t in tensors[1:]):
        raise ValueError("cat needs tensors on the same coordinates (the same geometry)")
    return SparseTensor.on(geometry, jax.numpy.concatenate([t.features for t in tensors], axis=1))


__all__ = ["Geometry", "SparseTensor", "cat", "check_features"]
