"""`SparseTensor` for JAX: features (a JAX array, traced under `jit`) on a static `Geometry`.

The geometry (coordinates, tensor stride and the core's kernel-map cache) is the pytree's auxiliary
data, so `jit` treats it as static: kernel maps are built in Python while tracing, from concrete
coordinates, and only the features flow through the compiled computation. Sizes depend on the
coordinates, so a new geometry means a new trace; tensors derived from one another share a cache,
so a U-Net builds each map once and its decoder reuses the encoder's maps.

Coordinates live where the features live: NumPy for features on a CPU device, CuPy for features
on a GPU (JAX arrays cross to CuPy through DLPack, without a copy).
"""

from __future__ import annotations

import jax
import numpy as np

from cupysparse.cuda.backend import cupy_module, gpu_available, is_cupy_array, to_device
from cupysparse.geometry.coords import as_tuple, validate_coordinates
from cupysparse.cuda.dtypes import FEATURE_DTYPES
from cupysparse.geometry.kernel_map import KernelMapCache

_GPU_PLATFORMS = ("gpu", "cuda")


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
        coords = _core_coordinates(coordinates, device)
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


def _core_coordinates(coordinates, device: str):
    if isinstance(coordinates, jax.core.Tracer):
        raise TypeError("coordinates must be concrete: build sparse tensors outside jit and pass them in")
    if isinstance(coordinates, jax.Array):
        if device == "cuda" and _platform(coordinates) in _GPU_PLATFORMS:
            return cupy_module().from_dlpack(coordinates)
        coordinates = np.asarray(coordinates)
    if not (isinstance(coordinates, np.ndarray) or is_cupy_array(coordinates)):
        raise TypeError(f"coordinates must be a NumPy, CuPy or JAX array, got {type(coordinates).__name__}")
    return to_device(coordinates, device)


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
