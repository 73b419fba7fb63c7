"""`read_points`: each format round-trips points written by its own library or by hand (struct, NumPy),
the same scan reads alike in every format, malformed files and missing libraries give clear errors.

A format whose library is not installed skips its tests (`pip install '.[test]'` installs them all).
"""

import struct
import sys

import numpy as np
import pytest

from cupysparse.data import read_points
from cupysparse.geometry.sparse_tensor import SparseTensor


@pytest.fixture(scope="module")
def scan():
    """A small LiDAR-like scan: float32 points on a 1 mm grid (exact in LAS too) and an intensity in [0, 1)."""
    rng = np.random.default_rng(0)
    points = (np.round(rng.uniform(-40.0, 40.0, (257, 3)), 3)).astype(np.float32)
    intensity = rng.uniform(0.0, 1.0, (257, 1)).astype(np.float32)
    return points, intensity


def write_kitti(path, points, intensity):
    np.concatenate([points, intensity], axis=1).astype("<f4").tofile(path)


# --- KITTI .bin -----------------------------------------------------------------------------------


def test_kitti_bin_written_by_hand(tmp_path):
    path = tmp_path / "000000.bin"
    path.write_bytes(struct.pack("<8f", 1.5, -2.0, 0.25, 0.5, 10.0, 20.0, -30.0, 0.0))

    points, features = read_points(path)

    assert points.dtype == np.float32 and features.dtype == np.float32
    assert points.tolist() == [[1.5, -2.0, 0.25], [10.0, 20.0, -30.0]]
    assert features.tolist() == [[0.5], [0.0]]


def test_kitti_bin_round_trip(tmp_path, scan):
    write_kitti(tmp_path / "scan.bin", *scan)
    points, features = read_points(tmp_path / "scan.bin")
    np.testing.assert_array_equal(points, scan[0])
    np.testing.assert_array_equal(features, scan[1])


def test_an_empty_kitti_bin_has_no_points(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    points, features = read_points(tmp_path / "empty.bin")
    assert points.shape == (0, 3) and features.shape == (0, 1)


def test_a_truncated_kitti_bin_is_refused(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(struct.pack("<8f", *range(8))[:-3])
    with pytest.raises(ValueError, match=r"cut\.bin: 29 bytes is not a multiple of 16 .*truncated"):
        read_points(path)


# --- .npy / .npz ------------------------------------------------------------------------------------


def test_npy_columns_after_xyz_are_features(tmp_path):
    array = np.array([[1.0, 2.0, 3.0, 0.5, 7.0], [4.0, 5.0, 6.0, 0.25, 8.0]])  # float64, converted
    np.save(tmp_path / "cloud.npy", array)

    points, features = read_points(tmp_path / "cloud.npy")

    assert points.dtype == np.float32 and features.dtype == np.float32
    assert points.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert features.tolist() == [[0.5, 7.0], [0.25, 8.0]]


def test_npy_of_three_columns_has_no_features(tmp_path, scan):
    np.save(tmp_path / "xyz.npy", scan[0])
    points, features = read_points(tmp_path / "xyz.npy")
    np.testing.assert_array_equal(points, scan[0])
    assert features is None


def test_npz_round_trip_ignores_other_keys(tmp_path, scan):
    labels = np.arange(len(scan[0]), dtype=np.int32)
    np.savez(tmp_path / "cloud.npz", points=scan[0], features=scan[1], labels=labels)

    points, features = read_points(tmp_path / "cloud.npz")

    np.testing.assert_array_equal(points, scan[0])
    np.testing.assert_array_equal(features, scan[1])


def test_npz_without_features_has_none(tmp_path, scan):
    np.savez_compressed(tmp_path / "cloud.npz", points=scan[0])
    points, features = read_points(tmp_path / "cloud.npz")
    np.testing.assert_array_equal(points, scan[0])
    assert features is None


def bad_numpy_files(tmp_path):
    np.save(tmp_path / "two_columns.npy", np.zeros((4, 2), np.float32))
    np.save(tmp_path / "flat.npy", np.zeros(12, np.float32))
    np.save(tmp_path / "objects.npy", np.array([[None, 1, 2]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "strings.npy", np.array([["a", "b", "c"]]))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "two_columns.npy").read_bytes()[:100])
    with open(tmp_path / "archive.npy", "wb") as file:  # np.savez would append .npz to the name
        np.savez(file, points=np.zeros((1, 3)))
    np.savez(tmp_path / "no_points.npz", xyz=np.zeros((1, 3)), labels=np.zeros(1))
    np.savez(tmp_path / "wide_points.npz", points=np.zeros((2, 4)))
    np.savez(tmp_path / "short_features.npz", points=np.zeros((2, 3)), features=np.zeros((1, 2)))
    with open(tmp_path / "array.npz", "wb") as file:
        np.save(file, np.zeros((2, 3)))
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 not really a zip")


BAD_NUMPY_FILES = {
    "two_columns.npy": r"\[P, 3 \+ C\].*got shape \(4, 2\)",
    "flat.npy": r"\[P, 3 \+ C\].*got shape \(12,\)",
    "objects.npy": "not a readable .npy file",
    "strings.npy": "points must be numbers",
    "cut.npy": "not a readable .npy file",
    "archive.npy": "holds a NpzFile, not the ndarray",
    "no_points.npz": r"needs an array 'points' \[P, 3\]; it has \['xyz', 'labels'\]",
    "wide_points.npz": r"'points' must have shape \[P, 3\], got \(2, 4\)",
    "short_features.npz": r"'features' must have shape \[2, C\] to match 'points', got \(1, 2\)",
    "array.npz": "holds a ndarray, not the NpzFile",
    "cut.npz": "not a readable .npz file",
}


@pytest.mark.parametrize("name, message", BAD_NUMPY_FILES.items(), ids=BAD_NUMPY_FILES.keys())
def test_malformed_numpy_files_are_refused_naming_the_file(tmp_path, name, message):
    bad_numpy_files(tmp_path)
    with pytest.raises(ValueError, match=message) as raised:
        read_points(tmp_path / name)
    assert name in str(raised.value)


# --- .ply ---------------------------------------------------------------------------------------------


def test_ply_written_by_hand_binary(tmp_path):
    header = (
        "ply\nformat binary_little_endian 1.0\ncomment by hand\nelement vertex 2\n"
        "property float x\nproperty float y\nproperty float z\nproperty float intensity\nproperty uchar red\n"
        "element face 0\nproperty list uchar int vertex_indices\nend_header\n"
    )
    body = struct.pack("<4fB", 1.5, -2.0, 0.25, 0.5, 200) + struct.pack("<4fB", 10.0, 20.0, -30.0, 0.0, 7)
    (tmp_path / "hand.ply").write_bytes(header.encode() + body)
    pytest.importorskip("plyfile")

    points, features = read_points(tmp_path / "hand.ply")

    assert points.tolist() == [[1.5, -2.0, 0.25], [10.0, 20.0, -30.0]]
    assert features.dtype == np.float32 and features.tolist() == [[0.5, 200.0], [0.0, 7.0]]


def test_ply_written_by_hand_ascii_without_features(tmp_path):
    text = ("ply\nformat ascii 1.0\nelement vertex 2\nproperty double x\nproperty double y\nproperty double z\n"
            "end_header\n0.5 1.5 -2.5\n3 4 5\n")
    (tmp_path / "hand.ply").write_text(text)
    pytest.importorskip("plyfile")

    points, features = read_points(tmp_path / "hand.ply")

    assert points.dtype == np.float32 and points.tolist() == [[0.5, 1.5, -2.5], [3.0, 4.0, 5.0]]
    assert features is None


def write_ply(path, points, intensity, text=False):
    plyfile = pytest.importorskip("plyfile")
    vertex = np.empty(len(points), dtype=[("x", "f4"), ("y", "f4"), ("z", "f4"), ("intensity", "f4")])
    vertex["x"], vertex["y"], vertex["z"] = points.T
    vertex["intensity"] = intensity[:, 0]
    plyfile.PlyData([plyfile.PlyElement.describe(vertex, "vertex")], text=text).write(str(path))


@pytest.mark.parametrize("text", [False, True], ids=["binary", "ascii"])
def test_ply_round_trip_through_plyfile(tmp_path, scan, text):
    write_ply(tmp_path / "scan.ply", *scan, text=text)
    points, features = read_points(tmp_path / "scan.ply")
    np.testing.assert_array_equal(points, scan[0])
    np.testing.assert_array_equal(features, scan[1])


BAD_PLY_FILES = {
    "no z": ("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nproperty float y\nproperty float red\n"
             "end_header\n1 2 3\n", r"vertex element has no z; its properties are \['x', 'y', 'red'\]"),
    "no vertex": ("ply\nformat ascii 1.0\nelement point 1\nproperty float x\nproperty float y\nproperty float z\n"
                  "end_header\n1 2 3\n", r"needs a 'vertex' element; it has \['point'\]"),
    "truncated": ("ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\nproperty float z\n"
                  "end_header\n1 2 3\n4 5\n", "not a readable PLY file"),
    "not a ply": ("solid cube\nfacet normal 0 0 1\n", "not a readable PLY file"),
}


@pytest.mark.parametrize("text, message", BAD_PLY_FILES.values(), ids=BAD_PLY_FILES.keys())
def test_malformed_ply_files_are_refused_naming_the_file(tmp_path, text, message):
    pytest.importorskip("plyfile")
    (tmp_path / "bad.ply").write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        read_points(tmp_path / "bad.ply")
    assert "bad.ply" in str(raised.value)


def test_a_truncated_binary_ply_is_refused(tmp_path, scan):
    write_ply(tmp_path / "full.ply", *scan)
    (tmp_path / "cut.ply").write_bytes((tmp_path / "full.ply").read_bytes()[:-5])
    with pytest.raises(ValueError, match="cut.ply is not a readable PLY file"):
        read_points(tmp_path / "cut.ply")


# --- .pcd -----------------------------------------------------------------------------------------------

PCD_HEADER = """# .PCD v0.7 - Point Cloud Data file format
VERSION 0.7
FIELDS x y z normal _ label
SIZE 4 4 4 4 1 2
TYPE F F F F U U
COUNT 1 1 1 3 2 1
WIDTH 2
HEIGHT 1
VIEWPOINT 0 0 0 1 0 0 0
POINTS 2
DATA {data}
"""


def test_pcd_written_by_hand_binary_skips_padding_and_spreads_counts(tmp_path):
    rows = [(1.5, -2.25, 3.0, 0.5, 0.25, 0.125, 9, 9, 7), (4.0, 5.0, -6.5, 1.0, 0.0, 0.0, 9, 9, 65535)]
    body = b"".join(struct.pack("<6f2BH", *row) for row in rows)
    (tmp_path / "hand.pcd").write_bytes(PCD_HEADER.format(data="binary").encode() + body)
    pytest.importorskip("pypcd4")

    points, features = read_points(tmp_path / "hand.pcd")

    assert points.tolist() == [[1.5, -2.25, 3.0], [4.0, 5.0, -6.5]]
    assert features.dtype == np.float32
    assert features.tolist() == [[0.5, 0.25, 0.125, 7.0], [1.0, 0.0, 0.0, 65535.0]]


def test_pcd_written_by_hand_ascii(tmp_path):
    body = "1.5 -2.25 3 0.5 0.25 0.125 9 9 7\n4 5 -6.5 1 0 0 9 9 65535\n"
    (tmp_path / "hand.pcd").write_text(PCD_HEADER.format(data="ascii") + body)
    pytest.importorskip("pypcd4")

    points, features = read_points(tmp_path / "hand.pcd")

    assert points.tolist() == [[1.5, -2.25, 3.0], [4.0, 5.0, -6.5]]
    assert features.tolist() == [[0.5, 0.25, 0.125, 7.0], [1.0, 0.0, 0.0, 65535.0]]


@pytest.mark.parametrize("encoding", ["binary", "binary_compressed", "ascii"])
def test_pcd_round_trip_through_pypcd4(tmp_path, scan, encoding):
    pypcd4 = pytest.importorskip("pypcd4")
    points, intensity = scan
    cloud = pypcd4.PointCloud.from_xyzi_points(np.concatenate([points, intensity], axis=1))
    cloud.save(tmp_path / "scan.pcd", encoding=pypcd4.Encoding(encoding))

    read, features = read_points(tmp_path / "scan.pcd")

    np.testing.assert_array_equal(read, points)
    np.testing.assert_allclose(features, intensity, rtol=1e-7 if encoding == "ascii" else 0)


def test_pcd_of_xyz_only_has_no_features(tmp_path, scan):
    pypcd4 = pytest.importorskip("pypcd4")
    pypcd4.PointCloud.from_xyz_points(scan[0]).save(tmp_path / "xyz.pcd")
    points, features = read_points(tmp_path / "xyz.pcd")
    np.testing.assert_array_equal(points, scan[0])
    assert features is None


def test_malformed_pcd_files_are_refused_naming_the_file(tmp_path):
    pytest.importorskip("pypcd4")
    no_z = PCD_HEADER.format(data="ascii").replace("FIELDS x y z", "FIELDS x y w")
    (tmp_path / "no_z.pcd").write_text(no_z + "1 2 3 0 0 0 0 0 1\n4 5 6 0 0 0 0 0 1\n")
    full = PCD_HEADER.format(data="binary").encode() + bytes(2 * 28)
    (tmp_path / "cut.pcd").write_bytes(full[:-5])
    (tmp_path / "garbage.pcd").write_text("hello\nworld\n")

    with pytest.raises(ValueError, match=r"no_z.pcd: the PCD file has no field z; its fields are \('x', 'y', 'w'"):
        read_points(tmp_path / "no_z.pcd")
    for name in ("cut.pcd", "garbage.pcd"):
        with pytest.raises(ValueError, match=f"{name} is not a readable PCD file"):
            read_points(tmp_path / name)


# --- .las / .laz -----------------------------------------------------------------------------------------


def write_las(path, points, intensity):
    laspy = pytest.importorskip("laspy")
    las = laspy.create(point_format=0, file_version="1.2")
    las.header.offsets = [0.0, 0.0, 0.0]
    las.header.scales = [0.001, 0.001, 0.001]
    las.x, las.y, las.z = points.astype(np.float64).T
    las.intensity = intensity
    las.write(str(path))


@pytest.mark.parametrize("suffix", [".las", ".laz"])
def test_las_round_trip_through_laspy(tmp_path, scan, suffix):
    if suffix == ".laz":
        pytest.importorskip("lazrs")
    points = scan[0]
    intensity = np.arange(len(points), dtype=np.uint16) * 250
    write_las(tmp_path / f"scan{suffix}", points, intensity)

    read, features = read_points(tmp_path / f"scan{suffix}")

    # LAS stores integers times the 1 mm scale: the points come back to float32 rounding.
    np.testing.assert_allclose(read, points, rtol=0, atol=1e-5)
    assert features.dtype == np.float32
    np.testing.assert_array_equal(features[:, 0], intensity)


CUT_LAS_MESSAGES = {
    # 20 bytes is one point of format 0: laspy itself would return the 256 others.
    ".las": r"cut\.las: the header announces 257 points but the file holds 256: it is truncated",
    ".laz": r"cut\.laz is not a readable \.laz file",
}


@pytest.mark.parametrize("suffix", [".las", ".laz"])
def test_malformed_las_files_are_refused_naming_the_file(tmp_path, scan, suffix):
    if suffix == ".laz":
        pytest.importorskip("lazrs")
    write_las(tmp_path / f"full{suffix}", scan[0], np.zeros(len(scan[0]), np.uint16))
    (tmp_path / f"cut{suffix}").write_bytes((tmp_path / f"full{suffix}").read_bytes()[:-20])
    (tmp_path / f"garbage{suffix}").write_bytes(b"not a LAS file at all" * 20)
    with pytest.raises(ValueError, match=CUT_LAS_MESSAGES[suffix]):
        read_points(tmp_path / f"cut{suffix}")
    with pytest.raises(ValueError, match=f"garbage{suffix} is not a readable {suffix} file"):
        read_points(tmp_path / f"garbage{suffix}")


def test_laz_without_a_decompressor_names_the_extra(tmp_path, scan, monkeypatch):
    laspy = pytest.importorskip("laspy")
    pytest.importorskip("lazrs")
    write_las(tmp_path / "scan.laz", scan[0], np.zeros(len(scan[0]), np.uint16))
    monkeypatch.setattr(laspy.LazBackend, "detect_available", staticmethod(lambda: ()))
    with pytest.raises(ImportError, match=r"\.laz files needs a LAZ decompressor.*pip install 'cupysparse\[las\]'"):
        read_points(tmp_path / "scan.laz")


# --- every format ----------------------------------------------------------------------------------------


def write_pcd(path, points, intensity):
    pypcd4 = pytest.importorskip("pypcd4")
    pypcd4.PointCloud.from_xyzi_points(np.concatenate([points, intensity], axis=1)).save(path)


# LAS is left out: it stores coordinates and intensity as integers.
WRITERS = {
    ".npy": lambda path, points, intensity: np.save(path, np.concatenate([points, intensity], axis=1)),
    ".npz": lambda path, points, intensity: np.savez(path, points=points, features=intensity),
    ".ply": write_ply,
    ".pcd": write_pcd,
}


@pytest.mark.parametrize("suffix", WRITERS)
def test_a_scan_reads_and_voxelises_as_its_kitti_bin_does(tmp_path, scan, suffix):
    write_kitti(tmp_path / "scan.bin", *scan)
    WRITERS[suffix](tmp_path / f"scan{suffix}", *scan)

    results = []
    for path in (tmp_path / "scan.bin", tmp_path / f"scan{suffix}"):
        points, features = read_points(path)
        tensor, point_to_voxel = SparseTensor.from_points(points, 0.5, features=features, return_index=True)
        results.append((points, features, tensor.point_features(point_to_voxel)))

    for from_bin, from_other in zip(*results):
        np.testing.assert_array_equal(from_other, from_bin)


# --- dispatch and missing libraries ------------------------------------------------------------------------


def test_the_suffix_is_matched_in_any_case(tmp_path, scan):
    write_kitti(tmp_path / "SCAN.BIN", *scan)
    points, _ = read_points(str(tmp_path / "SCAN.BIN"))
    np.testing.assert_array_equal(points, scan[0])


def test_an_unknown_suffix_lists_the_known_ones(tmp_path):
    (tmp_path / "scan.xyz").write_text("1 2 3\n")
    with pytest.raises(ValueError, match=r"unknown point-cloud suffix '\.xyz'.*\.bin, \.npy, \.npz, \.ply, \.pcd, "
                                         r"\.las, \.laz"):
        read_points(tmp_path / "scan.xyz")


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.ply"):
        read_points(tmp_path / "missing.ply")


@pytest.mark.parametrize("suffix, module, extra", [(".ply", "plyfile", "ply"), (".pcd", "pypcd4", "pcd"),
                                                   (".las", "laspy", "las"), (".laz", "laspy", "las")])
def test_a_missing_reader_library_names_the_extra_to_install(tmp_path, monkeypatch, suffix, module, extra):
    (tmp_path / f"scan{suffix}").write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail as if it were not installed
    with pytest.raises(ImportError, match=rf"reading \{suffix} files needs the {module} package: "
                                          rf"pip install 'cupysparse\[{extra}\]'"):
        read_points(tmp_path / f"scan{suffix}")
