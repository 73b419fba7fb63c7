"""Point-cloud files in: `read_points(path)` gives `(points, features)` for the formats LiDAR and 3D scans
come in, picked by the file's suffix.

`points` is float32 `[P, 3]` (x, y, z), `features` float32 `[P, C]` or None, rows in the file's order:

| suffix | format | features | needs |
|---|---|---|---|
| `.bin` | KITTI velodyne scan: float32 x, y, z, intensity per point, little endian | intensity `[P, 1]` | — |
| `.npy` | one array `[P, 3 + C]`: x, y, z, then C feature columns | the C columns, None if C = 0 | — |
| `.npz` | arrays `points` `[P, 3]`, optional `features` `[P, C]`; other keys ignored | `features` | — |
| `.ply` | the `vertex` element's `x`, `y`, `z` | its other scalar properties, in file order | `cupysparse[ply]` |
| `.pcd` | the fields `x`, `y`, `z` | the other fields but padding `_`, COUNT columns each | `cupysparse[pcd]` |
| `.las`, `.laz` | x, y, z scaled by the header | intensity `[P, 1]` | `cupysparse[las]` |

Feature values are converted to float32 as stored, unscaled (8-bit colours stay 0..255; a PCL packed `rgb`
float stays packed). The third-party readers (plyfile, pypcd4, laspy with lazrs) are imported only when a
file needs them. A malformed file raises ValueError naming the file; a missing reader library, ImportError
naming the extra to install.
"""

from __future__ import annotations

import importlib
import os
import zipfile
from pathlib import Path

import numpy as np

_KITTI_VALUES_PER_POINT = 4  # x, y, z, intensity
_KITTI_BYTES_PER_POINT = _KITTI_VALUES_PER_POINT * 4
_AXES = ("x", "y", "z")
_PCD_PADDING = "#$%&~~"  # how pypcd4 renames PCL's padding fields `_`: this prefix and six random characters


def read_points(path) -> tuple[np.ndarray, np.ndarray | None]:
    """`(points float32 [P, 3], features float32 [P, C] or None)` from a point-cloud file; the suffix
    (`.bin`, `.npy`, `.npz`, `.ply`, `.pcd`, `.las`, `.laz`, any case) picks the format."""
    path = Path(path)
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise ValueError(f"{path}: unknown point-cloud suffix {suffix!r}; read_points reads {', '.join(_READERS)}")
    if not path.is_file():
        raise FileNotFoundError(f"no point-cloud file at {path}")
    points, features = reader(path)
    return _as_float32(points, "points", path), None if features is None else _as_float32(features, "features", path)


def _as_float32(values: np.ndarray, name: str, path: Path) -> np.ndarray:
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"{path}: {name} must be numbers, got dtype {values.dtype}")
    return np.ascontiguousarray(values, dtype=np.float32)


def _import_reader(module: str, extra: str, suffix: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"reading {suffix} files needs the {module} package: pip install 'cupysparse[{extra}]'"
        ) from error


def _read_kitti_bin(path: Path):
    size = os.path.getsize(path)
    if size % _KITTI_BYTES_PER_POINT:
        raise ValueError(
            f"{path}: {size} bytes is not a multiple of {_KITTI_BYTES_PER_POINT} (float32 x, y, z, intensity per "
            "point): the file is truncated or not a KITTI scan"
        )
    values = np.fromfile(path, dtype="<f4").reshape(-1, _KITTI_VALUES_PER_POINT)
    return values[:, :3], values[:, 3:]


def _load_numpy(path: Path, kind: type):
    """`np.load` of a `kind` (an array for .npy, an archive for .npz), never unpickling: a file must not run code."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path} is not a readable {path.suffix} file: {error}") from error
    if not isinstance(loaded, kind):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not the {kind.__name__} a {path.suffix} file holds")
    return loaded


def _read_npy(path: Path):
    array = _load_numpy(path, np.ndarray)
    if array.ndim != 2 or array.shape[1] < 3:
        raise ValueError(
            f"{path}: a .npy point cloud is one array [P, 3 + C] (x, y, z, then C feature columns), got shape "
            f"{array.shape}"
        )
    return array[:, :3], array[:, 3:] if array.shape[1] > 3 else None


def _read_npz(path: Path):
    with _load_numpy(path, np.lib.npyio.NpzFile) as archive:
        if "points" not in archive.files:
            raise ValueError(f"{path}: a .npz point cloud needs an array 'points' [P, 3]; it has {archive.files}")
        points = archive["points"]
        features = archive["features"] if "features" in archive.files else None
    if points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"{path}: 'points' must have shape [P, 3], got {points.shape}")
    if features is not None and (features.ndim != 2 or features.shape[0] != points.shape[0]):
        raise ValueError(f"{path}: 'features' must have shape [{points.shape[0]}, C] to match 'points', got "
                         f"{features.shape}")
    return points, features


def _read_ply(path: Path):
    plyfile = _import_reader("plyfile", "ply", ".ply")
    try:
        ply = plyfile.PlyData.read(str(path))
    except plyfile.PlyParseError as error:
        raise ValueError(f"{path} is not a readable PLY file: {error}") from error
    if "vertex" not in ply:
        raise ValueError(f"{path}: a PLY point cloud needs a 'vertex' element; it has "
                         f"{[element.name for element in ply.elements]}")
    vertex = ply["vertex"]
    names = [prop.name for prop in vertex.properties if not isinstance(prop, plyfile.PlyListProperty)]
    missing = [axis for axis in _AXES if axis not in names]
    if missing:
        raise ValueError(f"{path}: the PLY vertex element has no {'/'.join(missing)}; its properties are {names}")
    feature_names = [name for name in names if name not in _AXES]
    points = np.stack([vertex[axis] for axis in _AXES], axis=1)
    return points, np.stack([vertex[name] for name in feature_names], axis=1) if feature_names else None


def _read_pcd(path: Path):
    pypcd4 = _import_reader("pypcd4", "pcd", ".pcd")
    try:
        cloud = pypcd4.PointCloud.from_path(path)
    except (ValueError, KeyError, IndexError) as error:  # pydantic's header errors are ValueErrors too
        raise ValueError(f"{path} is not a readable PCD file: {error}") from error
    # `cloud.fields` has one name per column: a field of COUNT n becomes n columns `name__0000`, ….
    missing = [axis for axis in _AXES if axis not in cloud.fields]
    if missing:
        raise ValueError(f"{path}: the PCD file has no field {'/'.join(missing)}; its fields are "
                         f"{cloud.metadata.fields}")
    feature_names = [name for name in cloud.fields if name not in _AXES and not name.startswith(_PCD_PADDING)]
    return cloud.numpy(_AXES), cloud.numpy(feature_names) if feature_names else None


def _read_las(path: Path):
    suffix = path.suffix.lower()
    laspy = _import_reader("laspy", "las", suffix)
    if suffix == ".laz" and not laspy.LazBackend.detect_available():
        raise ImportError("reading .laz files needs a LAZ decompressor for laspy: pip install 'cupysparse[las]'")
    try:
        las = laspy.read(path)
    except (laspy.LaspyException, ValueError, RuntimeError) as error:  # lazrs: RuntimeError for corrupt data
        raise ValueError(f"{path} is not a readable {suffix} file: {error}") from error
    # laspy only logs a short read and returns the points it found.
    if len(las.points) != las.header.point_count:
        raise ValueError(f"{path}: the header announces {las.header.point_count} points but the file holds "
                         f"{len(las.points)}: it is truncated")
    # Scaled coordinates are float64; float32 resolves 1 cm only within about 65 km of the origin.
    points = np.stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)], axis=1)
    return points, np.asarray(las.intensity)[:, None]


_READERS = {
    ".bin": _read_kitti_bin,
    ".npy": _read_npy,
    ".npz": _read_npz,
    ".ply": _read_ply,
    ".pcd": _read_pcd,
    ".las": _read_las,
    ".laz": _read_las,
}
