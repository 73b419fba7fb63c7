"""Synthetic scenes: determinism, voxel-count sizing, array contracts, geometry, argument checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cupysparse.data import scenes
from cupysparse.data.scenes import Scene, indoor_room, make_scene, outdoor_lidar


@pytest.fixture(scope="module")
def room() -> Scene:
    return indoor_room(20_000, seed=0)


@pytest.fixture(scope="module")
def street() -> Scene:
    """Large enough to need several sweeps."""
    return outdoor_lidar(300_000, seed=0)


def reference_voxels(scene: Scene) -> np.ndarray:
    return np.unique(np.floor(scene.points / scene.voxel_size).astype(np.int64), axis=0)


@pytest.mark.parametrize("scene_name", ["room", "street"])
def test_arrays_have_the_documented_types_and_shapes(scene_name, request):
    scene = request.getfixturevalue(scene_name)
    assert scene.points.dtype == np.float32 and scene.points.ndim == 2
    assert scene.points.shape[1] == 3
    assert scene.labels.dtype == np.int32 and scene.labels.shape == (len(scene.points),)
    assert isinstance(scene.class_names, tuple)
    assert all(isinstance(name, str) for name in scene.class_names)
    assert type(scene.voxel_size) is float
    voxels = scene.voxel_coordinates()
    assert voxels.dtype == np.int32 and voxels.shape[1] == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        scene.name = "renamed"


@pytest.mark.parametrize("scene_name", ["room", "street"])
def test_voxel_coordinates_are_the_unique_floored_points(scene_name, request):
    scene = request.getfixturevalue(scene_name)
    np.testing.assert_array_equal(scene.voxel_coordinates(), reference_voxels(scene))


def test_voxel_coordinates_handle_negative_points_and_an_empty_scene():
    points = np.array([[-0.01, 0.0, 0.19], [-0.09, 0.05, 0.11], [0.3, -0.2, 0.0]], np.float32)
    scene = Scene("tiny", points, np.zeros(3, np.int32), ("thing",), 0.1)
    np.testing.assert_array_equal(scene.voxel_coordinates(), [[-1, 0, 1], [3, -2, 0]])
    empty = Scene("empty", np.zeros((0, 3), np.float32), np.zeros(0, np.int32), ("thing",), 0.1)
    assert empty.voxel_coordinates().shape == (0, 3)


@pytest.mark.parametrize("kind", ["indoor", "outdoor"])
def test_same_seed_gives_identical_scenes_and_another_seed_a_different_one(kind):
    first, again = make_scene(kind, 5_000, seed=3), make_scene(kind, 5_000, seed=3)
    np.testing.assert_array_equal(first.points, again.points)
    np.testing.assert_array_equal(first.labels, again.labels)
    np.testing.assert_array_equal(first.sensor_origins, again.sensor_origins)
    other = make_scene(kind, 5_000, seed=4)
    assert first.points.shape != other.points.shape or not np.array_equal(first.points, other.points)


@pytest.mark.parametrize(
    ("kind", "num_voxels", "seed", "voxel_size"),
    [
        ("indoor", 1_000, 0, None),
        ("indoor", 12_345, 1, None),
        ("indoor", 100_000, 2, None),
        ("indoor", 30_000, 5, 0.05),
        ("outdoor", 1_000, 0, None),
        ("outdoor", 12_345, 1, None),
        ("outdoor", 100_000, 2, None),
        ("outdoor", 150_000, 3, 0.1),
    ],
)
def test_voxel_count_is_within_five_percent_of_the_target(kind, num_voxels, seed, voxel_size):
    scene = make_scene(kind, num_voxels, seed=seed, voxel_size=voxel_size)
    count = len(reference_voxels(scene))
    assert abs(count - num_voxels) <= 0.05 * num_voxels, count


def test_make_scene_uses_each_kinds_default_voxel_size():
    assert make_scene("indoor", 2_000).voxel_size == 0.02
    assert make_scene("outdoor", 2_000).voxel_size == 0.05
    assert make_scene("outdoor", 2_000, voxel_size=0.08).voxel_size == 0.08


def test_room_has_its_structure_and_furniture(room):
    names = [room.class_names[label] for label in np.unique(room.labels)]
    assert {"floor", "wall", "table", "chair"} <= set(names)
    assert room.labels.min() >= 0 and room.labels.max() < len(room.class_names)
    assert room.name == "indoor_room" and room.sensor_origins.shape == (0, 3)


def test_room_floor_is_one_voxel_layer_without_holes(room):
    floor = room.points[room.labels == room.class_names.index("floor")]
    cells = np.unique(np.floor(floor / room.voxel_size).astype(np.int64), axis=0)
    assert np.unique(cells[:, 2]).tolist() == [0]
    extent = cells.max(axis=0) - cells.min(axis=0) + 1
    assert len(cells) == extent[0] * extent[1]
    # Everything else stands on the floor, inside the walls.
    voxels = room.voxel_coordinates()
    assert (voxels.min(axis=0) == cells.min(axis=0)).all()
    assert (voxels[:, :2].max(axis=0) == cells[:, :2].max(axis=0)).all()


def test_room_scales_with_the_target():
    small, large = indoor_room(5_000, seed=1), indoor_room(80_000, seed=1)
    small_extent = np.ptp(small.points[:, :2], axis=0).prod()
    large_extent = np.ptp(large.points[:, :2], axis=0).prod()
    assert large_extent > 8 * small_extent


def test_street_has_ground_cars_and_buildings(street):
    names = {street.class_names[label] for label in np.unique(street.labels)}
    assert {"road", "sidewalk", "car", "pole", "building"} <= names
    assert street.labels.min() >= 0 and street.labels.max() < len(street.class_names)
    assert street.name == "outdoor_lidar"


def test_street_sweeps_come_from_a_sensor_driving_along_the_road(street):
    origins = street.sensor_origins
    assert origins.dtype == np.float32 and len(origins) > 1
    np.testing.assert_allclose(origins[:, 2], scenes.LIDAR_SENSOR_HEIGHT_M)
    np.testing.assert_allclose(origins[:, 1], origins[0, 1])
    np.testing.assert_allclose(np.diff(origins[:, 0]), scenes.SWEEP_SPACING_M)


def test_street_points_are_within_range_of_a_sensor(street):
    distance = np.linalg.norm(street.points[:, None, :] - street.sensor_origins[None], axis=2)
    nearest = distance.min(axis=1)
    assert nearest.max() <= scenes.LIDAR_MAX_RANGE_M + 1e-3
    # Nothing closer than where the lowest beam meets the ground, but for cars parked alongside.
    assert nearest.min() > 1.0


def test_street_ground_is_at_zero_height_and_objects_stand_on_it(street):
    ground = np.isin(street.labels, [street.class_names.index(n) for n in ("road", "sidewalk", "terrain")])
    assert ground.mean() > 0.3
    assert np.abs(street.points[ground, 2]).max() < 0.05
    cars = street.points[street.labels == street.class_names.index("car")]
    assert cars[:, 2].min() > 0.15 and cars[:, 2].max() < 1.8
    assert street.points[:, 2].min() > -0.05


def test_small_outdoor_target_keeps_one_sweep():
    scene = outdoor_lidar(2_000, seed=0)
    assert len(scene.sensor_origins) == 1


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: make_scene("forest", 1_000), ValueError, r"kind must be one of \['indoor', 'outdoor'\]"),
        (lambda: make_scene(None, 1_000), ValueError, "kind"),
        (lambda: make_scene("indoor", 0), ValueError, "num_voxels"),
        (lambda: make_scene("outdoor", -5), ValueError, "num_voxels"),
        (lambda: indoor_room(999), ValueError, "num_voxels must be between 1000"),
        (lambda: outdoor_lidar(scenes.MAX_NUM_VOXELS + 1), ValueError, "num_voxels"),
        (lambda: make_scene("indoor", 1_500.0), TypeError, "num_voxels must be an int"),
        (lambda: make_scene("indoor", True), TypeError, "num_voxels"),
        (lambda: make_scene("outdoor", "1000"), TypeError, "num_voxels"),
        (lambda: make_scene("indoor", 2_000, seed=-1), ValueError, "seed"),
        (lambda: make_scene("indoor", 2_000, seed=1.0), TypeError, "seed"),
        (lambda: make_scene("indoor", 2_000, voxel_size=0.0), ValueError, "voxel_size"),
        (lambda: make_scene("indoor", 2_000, voxel_size=-0.02), ValueError, "voxel_size"),
        (lambda: make_scene("indoor", 2_000, voxel_size=float("nan")), ValueError, "voxel_size"),
        (lambda: make_scene("indoor", 2_000, voxel_size="0.02"), TypeError, "voxel_size"),
        (lambda: make_scene("outdoor", 2_000, voxel_size=0.02), ValueError, "voxel_size must be between"),
        (lambda: make_scene("outdoor", 2_000, voxel_size=0.2), ValueError, "voxel_size must be between"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
