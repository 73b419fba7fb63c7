"""Deterministic synthetic point-cloud scenes, sized by a target number of occupied voxels.

They are the embedded default data for demos, tests and benchmarks (NumPy only):

* `indoor_room`: points sampled on the surfaces of a furnished room, as an RGB-D reconstruction
  gives them, at 2 cm voxels by default;
* `outdoor_lidar`: 64-beam rotating LiDAR sweeps ray-cast against a street, at 5 cm voxels by
  default; several sweeps from a driving ego vehicle are accumulated for large targets.

The same arguments always give the same scene, and the number of unique voxels,
`len(scene.voxel_coordinates())`, is within ±5% of `num_voxels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

SIZE_TOLERANCE = 0.05
MAX_NUM_VOXELS = 5_000_000
# Below this a room is a few voxels across, its count too coarse to size within the tolerance.
INDOOR_MIN_NUM_VOXELS = 1_000

INDOOR_CLASSES = (
    "floor", "wall", "ceiling", "table", "chair", "cabinet", "bookshelf", "sofa", "box",
)
FLOOR, WALL, CEILING, TABLE, CHAIR, CABINET, BOOKSHELF, SOFA, BOX = range(len(INDOOR_CLASSES))

OUTDOOR_CLASSES = ("road", "sidewalk", "terrain", "car", "pole", "building")
ROAD, SIDEWALK, TERRAIN, CAR, POLE, BUILDING = range(len(OUTDOOR_CLASSES))

LIDAR_BEAMS = 64
LIDAR_ELEVATION_DEG = (-25.0, 3.0)
LIDAR_COLUMNS = 2048
LIDAR_MIN_COLUMNS = 64
LIDAR_SENSOR_HEIGHT_M = 1.8
LIDAR_MAX_RANGE_M = 75.0
LIDAR_RANGE_NOISE_M = 0.02
LIDAR_VOXEL_SIZE_RANGE_M = (0.05, 0.1)
SWEEP_SPACING_M = 5.0  # key frames at 2 Hz driving at 10 m/s, as nuScenes annotates
MAX_SWEEPS = 400

# Street cross-section, y across the road; the ego drives along +x in the right-hand lane.
LANE_WIDTH_M = 3.5
PARKING_WIDTH_M = 2.2
ROAD_HALF_WIDTH_M = LANE_WIDTH_M + PARKING_WIDTH_M
SIDEWALK_OUTER_M = ROAD_HALF_WIDTH_M + 3.3
EGO_LANE_Y_M = -LANE_WIDTH_M / 2
STREET_SEGMENT_M = 50.0
STREET_START_M = -2 * STREET_SEGMENT_M  # behind the first sensor by more than the maximum range

# Room layout (metres, before the room is scaled to the target).
MIN_FLOOR_AREA_M2 = 12.0  # room for a few pieces; smaller targets shrink the whole room
FURNITURE_AREA_PER_FLOOR_AREA = 0.7  # first guess only: the layout's exact area is measured
FURNITURE_GROUPS_PER_M2 = 0.2
MIN_FURNITURE_GROUPS = 3
WALL_GAP_M = 0.03
FURNITURE_CLEARANCE_M = 0.3
PLACEMENT_ATTEMPTS = 30
MAX_SCALE_ITERATIONS = 10


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value
class Scene:
    """A labelled point cloud.

    `points` float32 `[M, 3]` in metres, `labels` int32 `[M]` indexing `class_names`,
    `sensor_origins` float32 `[S, 3]` the LiDAR position of each sweep (empty for indoor scenes).
    """

    name: str
    points: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    voxel_size: float
    sensor_origins: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))

    def voxel_coordinates(self) -> np.ndarray:
        """Unique integer voxel coordinates `floor(points / voxel_size)`, int32 `[V, 3]`, sorted."""
        keys, low, extent = _voxel_keys(self.points, self.voxel_size)
        keys = _unique(keys)
        coords = np.empty((len(keys), 3), np.int64)
        keys, coords[:, 2] = np.divmod(keys, extent[2])
        coords[:, 0], coords[:, 1] = np.divmod(keys, extent[1])
        return (coords + low).astype(np.int32)


def make_scene(kind: str, num_voxels: int, seed: int = 0, voxel_size: float | None = None) -> Scene:
    """Build the scene `kind` ('indoor' or 'outdoor'); `voxel_size=None` takes its default."""
    builders = {"indoor": indoor_room, "outdoor": outdoor_lidar}
    if not isinstance(kind, str) or kind not in builders:
        raise ValueError(f"kind must be one of {sorted(builders)}, got {kind!r}")
    if voxel_size is None:
        return builders[kind](num_voxels, seed)
    return builders[kind](num_voxels, seed, voxel_size)


# --------------------------------------------------------------------------------------------
# Indoor room


def indoor_room(num_voxels: int = 200_000, seed: int = 0, voxel_size: float = 0.02) -> Scene:
    """A furnished room: floor, walls, a ceiling for half the seeds, tables and chairs, cabinets,
    bookshelves, sofas and boxes, as points on their surfaces.

    The layout is drawn for a room whose surface area matches the target, then the whole room is
    scaled until the voxel count is within ±5% of `num_voxels` (small targets give a doll's house).
    """
    _check_num_voxels(num_voxels, INDOOR_MIN_NUM_VOXELS)
    _check_seed(seed)
    _check_voxel_size(voxel_size)
    faces = _room_faces(num_voxels * voxel_size**2, np.random.default_rng([seed, 0]))
    layout_area = np.linalg.norm(np.cross(faces.edge_a, faces.edge_b), axis=1).sum()
    # A plane of area A covers about A / voxel_size² voxels, so area, hence count, goes as scale².
    scale = math.sqrt(num_voxels * voxel_size**2 / layout_area)
    too_small, too_large = 0.0, math.inf  # scales known to give too few / too many voxels
    best = None
    for _ in range(MAX_SCALE_ITERATIONS):
        points, labels = _sample_faces(faces, scale, voxel_size, np.random.default_rng([seed, 1]))
        count = _count_voxels(points, voxel_size)
        if best is None or abs(count - num_voxels) < abs(best[0] - num_voxels):
            best = count, points, labels
        if abs(count - num_voxels) <= SIZE_TOLERANCE / 2 * num_voxels:
            break
        if count < num_voxels:
            too_small = max(too_small, scale)
        else:
            too_large = min(too_large, scale)
        scale *= math.sqrt(num_voxels / count)
        if not too_small < scale < too_large:  # the count is a step function at small scales
            scale = (too_small + too_large) / 2
    count, points, labels = best
    _check_size(count, num_voxels, "indoor_room")
    return Scene("indoor_room", points, labels, INDOOR_CLASSES, float(voxel_size))


@dataclass(frozen=True)
class _Faces:
    """Parallelograms `origin + u * edge_a + v * edge_b` for u, v in [0, 1)."""

    origin: np.ndarray
    edge_a: np.ndarray
    edge_b: np.ndarray
    label: np.ndarray

    @staticmethod
    def concatenate(parts: list[_Faces]) -> _Faces:
        return _Faces(*(np.concatenate([getattr(p, name) for p in parts])
                        for name in ("origin", "edge_a", "edge_b", "label")))


def _room_faces(target_area: float, rng: np.random.Generator) -> _Faces:
    """Floor, walls, optional ceiling and furniture of a room of about `target_area` m² surface."""
    height = rng.uniform(2.5, 3.0)
    aspect = rng.uniform(1.0, 1.8)
    has_ceiling = rng.random() < 0.5
    # Surface area = a·s² + b·s for a floor of side s (floor, ceiling and furniture grow with the
    # floor, walls with its perimeter): solve for s.
    a = 1 + has_ceiling + FURNITURE_AREA_PER_FLOOR_AREA
    b = 2 * height * (math.sqrt(aspect) + 1 / math.sqrt(aspect))
    side = (-b + math.sqrt(b * b + 4 * a * target_area)) / (2 * a)
    floor_area = max(side * side, MIN_FLOOR_AREA_M2)
    width, depth = math.sqrt(floor_area * aspect), math.sqrt(floor_area / aspect)

    x, y, z = np.eye(3)
    planes = [(0 * x, width * x, depth * y, FLOOR),
              (0 * x, width * x, height * z, WALL),
              (depth * y, width * x, height * z, WALL),
              (0 * x, depth * y, height * z, WALL),
              (width * x, depth * y, height * z, WALL)]
    if has_ceiling:
        planes.append((height * z, width * x, depth * y, CEILING))
    origin, edge_a, edge_b, label = zip(*planes)
    room = _Faces(np.array(origin), np.array(edge_a), np.array(edge_b), np.array(label))
    return _Faces.concatenate([room, _box_faces(_furnish(width, depth, rng))])


def _furnish(width: float, depth: float, rng: np.random.Generator) -> np.ndarray:
    """Furniture boxes placed without overlap in a `width` × `depth` room."""
    along_wall = {"cabinet": _cabinet, "bookshelf": _bookshelf, "sofa": _sofa}
    free_standing = {"dining set": _dining_set, "boxes": _boxes}
    kinds = list(along_wall) + list(free_standing)
    kind_odds = [0.15, 0.15, 0.15, 0.3, 0.25]
    builders = along_wall | free_standing
    # Local +y is an object's back; these yaws turn it to the north, east, south and west walls.
    wall_yaws = (0.0, -np.pi / 2, np.pi, np.pi / 2)

    placed_boxes = []
    placed_bounds = np.zeros((0, 4))  # xmin, ymin, xmax, ymax
    groups = max(MIN_FURNITURE_GROUPS, round(width * depth * FURNITURE_GROUPS_PER_M2))
    for group in range(groups):
        # A dining set first, while the floor is empty: every room gets tables and chairs.
        kind = kinds[rng.choice(len(kinds), p=kind_odds)] if group else "dining set"
        boxes = builders[kind](rng)
        for _ in range(PLACEMENT_ATTEMPTS):
            if kind in along_wall:
                wall = rng.integers(4)
                yaw = wall_yaws[wall]
            else:
                yaw = rng.integers(4) * np.pi / 2 + rng.uniform(-0.25, 0.25)
            turned = _place(boxes, 0.0, 0.0, yaw)
            xmin, ymin, xmax, ymax = _footprint(turned)
            x_range = (WALL_GAP_M - xmin, width - WALL_GAP_M - xmax)
            y_range = (WALL_GAP_M - ymin, depth - WALL_GAP_M - ymax)
            if x_range[0] > x_range[1] or y_range[0] > y_range[1]:
                continue
            x, y = rng.uniform(*x_range), rng.uniform(*y_range)
            if kind in along_wall:
                x, y = ((x, y_range[1]), (x_range[1], y), (x, y_range[0]), (x_range[0], y))[wall]
            bounds = np.array([xmin + x, ymin + y, xmax + x, ymax + y])
            overlaps = ((bounds[:2] < placed_bounds[:, 2:] + FURNITURE_CLEARANCE_M)
                        & (bounds[2:] + FURNITURE_CLEARANCE_M > placed_bounds[:, :2])).all(axis=1)
            if not overlaps.any():
                placed_boxes.append(_place(turned, x, y, 0.0))
                placed_bounds = np.vstack([placed_bounds, bounds])
                break
    return np.concatenate(placed_boxes) if placed_boxes else np.zeros((0, 8))


# Boxes are rows (centre x, y, z, half size x, y, z, yaw about z, label).


def _box(x0: float, x1: float, y0: float, y1: float, z0: float, z1: float,
         label: int) -> list[float]:
    return [(x0 + x1) / 2, (y0 + y1) / 2, (z0 + z1) / 2,
            (x1 - x0) / 2, (y1 - y0) / 2, (z1 - z0) / 2, 0.0, label]


def _place(boxes: np.ndarray, x: float, y: float, yaw: float) -> np.ndarray:
    """Boxes turned by `yaw` about the z axis through the origin, then moved by (x, y)."""
    cos, sin = math.cos(yaw), math.sin(yaw)
    placed = boxes.copy()
    placed[:, 0] = cos * boxes[:, 0] - sin * boxes[:, 1] + x
    placed[:, 1] = sin * boxes[:, 0] + cos * boxes[:, 1] + y
    placed[:, 6] += yaw
    return placed


def _footprint(boxes: np.ndarray) -> tuple[float, float, float, float]:
    """Axis-aligned bounds (xmin, ymin, xmax, ymax) of the boxes' turned footprints."""
    cos, sin = np.abs(np.cos(boxes[:, 6])), np.abs(np.sin(boxes[:, 6]))
    reach_x = cos * boxes[:, 3] + sin * boxes[:, 4]
    reach_y = sin * boxes[:, 3] + cos * boxes[:, 4]
    return ((boxes[:, 0] - reach_x).min(), (boxes[:, 1] - reach_y).min(),
            (boxes[:, 0] + reach_x).max(), (boxes[:, 1] + reach_y).max())


def _table(rng: np.random.Generator) -> tuple[np.ndarray, float, float, float]:
    width, depth, height = rng.uniform(1.0, 2.0), rng.uniform(0.7, 1.0), rng.uniform(0.70, 0.78)
    top, leg, inset = 0.04, 0.05, 0.06
    boxes = [_box(-width / 2, width / 2, -depth / 2, depth / 2, height - top, height, TABLE)]
    for x in (-width / 2 + inset, width / 2 - inset - leg):
        for y in (-depth / 2 + inset, depth / 2 - inset - leg):
            boxes.append(_box(x, x + leg, y, y + leg, 0.0, height - top, TABLE))
    return np.array(boxes), width, depth, height


def _chair(rng: np.random.Generator) -> np.ndarray:
    half, height, back = rng.uniform(0.21, 0.24), rng.uniform(0.43, 0.47), rng.uniform(0.35, 0.5)
    board, leg = 0.04, 0.04
    boxes = [_box(-half, half, -half, half, height - board, height, CHAIR),
             _box(-half, half, half - board, half, height, height + back, CHAIR)]
    for x in (-half, half - leg):
        for y in (-half, half - leg):
            boxes.append(_box(x, x + leg, y, y + leg, 0.0, height - board, CHAIR))
    return np.array(boxes)


def _dining_set(rng: np.random.Generator) -> np.ndarray:
    """A table with chairs along both long sides and a few small boxes on top."""
    table, width, depth, height = _table(rng)
    parts = [table]
    chairs_per_side = max(1, int(width // 0.65))
    for side in (-1, 1):
        for slot in range(chairs_per_side):
            if rng.random() < 0.75:
                x = (slot + 0.5) * width / chairs_per_side - width / 2
                # Backs (local +y) away from the table.
                yaw = (0.0 if side > 0 else np.pi) + rng.uniform(-0.2, 0.2)
                parts.append(_place(_chair(rng), x, side * (depth / 2 + 0.12), yaw))
    for _ in range(rng.integers(0, 3)):
        size_x, size_y, size_z = rng.uniform(0.1, 0.3, size=3)
        item = np.array([_box(-size_x / 2, size_x / 2, -size_y / 2, size_y / 2,
                              height, height + size_z, BOX)])
        parts.append(_place(item, rng.uniform(-0.3, 0.3) * width, rng.uniform(-0.3, 0.3) * depth,
                            rng.uniform(0, np.pi)))
    return np.concatenate(parts)


def _cabinet(rng: np.random.Generator) -> np.ndarray:
    width, depth, height = rng.uniform(0.5, 1.6), rng.uniform(0.4, 0.6), rng.uniform(0.8, 2.0)
    return np.array([_box(-width / 2, width / 2, -depth / 2, depth / 2, 0.0, height, CABINET)])


def _bookshelf(rng: np.random.Generator) -> np.ndarray:
    """Open at the front (-y): two sides, a back, a top and evenly spaced shelves."""
    width, depth, height = rng.uniform(0.7, 1.2), rng.uniform(0.28, 0.4), rng.uniform(1.5, 2.2)
    board = 0.02
    boxes = [_box(-width / 2, -width / 2 + board, -depth / 2, depth / 2, 0.0, height, BOOKSHELF),
             _box(width / 2 - board, width / 2, -depth / 2, depth / 2, 0.0, height, BOOKSHELF),
             _box(-width / 2, width / 2, depth / 2 - board, depth / 2, 0.0, height, BOOKSHELF),
             _box(-width / 2, width / 2, -depth / 2, depth / 2, height - board, height, BOOKSHELF)]
    for z in np.linspace(0.0, height - board, int(height // 0.35) + 1)[:-1]:
        boxes.append(_box(-width / 2 + board, width / 2 - board, -depth / 2, depth / 2 - board,
                          z, z + board, BOOKSHELF))
    return np.array(boxes)


def _sofa(rng: np.random.Generator) -> np.ndarray:
    width, depth = rng.uniform(1.6, 2.6), rng.uniform(0.85, 1.0)
    seat, back_top, arm_top, arm = (rng.uniform(0.38, 0.45), rng.uniform(0.75, 0.9),
                                    rng.uniform(0.55, 0.65), rng.uniform(0.15, 0.25))
    back = 0.2
    return np.array([
        _box(-width / 2, width / 2, -depth / 2, depth / 2, 0.0, seat, SOFA),
        _box(-width / 2, width / 2, depth / 2 - back, depth / 2, seat, back_top, SOFA),
        _box(-width / 2, -width / 2 + arm, -depth / 2, depth / 2 - back, seat, arm_top, SOFA),
        _box(width / 2 - arm, width / 2, -depth / 2, depth / 2 - back, seat, arm_top, SOFA),
    ])


def _boxes(rng: np.random.Generator) -> np.ndarray:
    """A row of storage boxes, some with a smaller one stacked on top."""
    boxes, x = [], 0.0
    for _ in range(rng.integers(1, 5)):
        size_x, size_y, size_z = rng.uniform(0.25, 0.6, size=3)
        boxes.append(_box(x, x + size_x, -size_y / 2, size_y / 2, 0.0, size_z, BOX))
        if rng.random() < 0.3:
            top = rng.uniform(0.15, min(size_x, size_y))
            top_height = size_z + rng.uniform(0.1, 0.3)
            boxes.append(_box(x, x + top, -top / 2, top / 2, size_z, top_height, BOX))
        x += size_x + rng.uniform(0.05, 0.2)
    return _place(np.array(boxes), -x / 2, 0.0, 0.0)


def _box_faces(boxes: np.ndarray) -> _Faces:
    """The six faces of each box, less the bottoms of those standing on the floor (never seen)."""
    cos, sin, zero = np.cos(boxes[:, 6]), np.sin(boxes[:, 6]), np.zeros(len(boxes))
    axis_x = np.stack([cos, sin, zero], axis=1) * 2 * boxes[:, 3:4]
    axis_y = np.stack([-sin, cos, zero], axis=1) * 2 * boxes[:, 4:5]
    axis_z = np.stack([zero, zero, 2 * boxes[:, 5]], axis=1)
    corner = boxes[:, :3] - (axis_x + axis_y + axis_z) / 2
    origin = np.stack([corner, corner + axis_x, corner, corner + axis_y, corner, corner + axis_z])
    edge_a = np.stack([axis_y, axis_y, axis_x, axis_x, axis_x, axis_x])
    edge_b = np.stack([axis_z, axis_z, axis_z, axis_z, axis_y, axis_y])
    keep = np.ones((6, len(boxes)), bool)
    keep[4] = corner[:, 2] > 1e-6
    return _Faces(origin[keep], edge_a[keep], edge_b[keep],
                  np.broadcast_to(boxes[:, 7].astype(np.int32), keep.shape)[keep])


def _sample_faces(faces: _Faces, scale: float, voxel_size: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Points on the faces scaled by `scale`, one at a random place in each cell of a grid of
    pitch ≤ voxel_size / 2, so that an axis-aligned surface leaves no voxel it crosses empty.
    The points stay on the surfaces: noise across them would make a plane one or two voxels thick
    depending on where it falls, and the count jump as the room is scaled."""
    edge_a, edge_b = faces.edge_a * scale, faces.edge_b * scale
    spacing = voxel_size / 2
    cells_a = np.maximum(1, np.ceil(np.linalg.norm(edge_a, axis=1) / spacing)).astype(np.int64)
    cells_b = np.maximum(1, np.ceil(np.linalg.norm(edge_b, axis=1) / spacing)).astype(np.int64)
    cells = cells_a * cells_b
    total = int(cells.sum())
    face = np.repeat(np.arange(len(cells)), cells)
    index_in_face = np.arange(total) - np.repeat(np.cumsum(cells) - cells, cells)
    row, column = np.divmod(index_in_face, cells_b[face])
    u = (row + rng.random(total, dtype=np.float32)) / cells_a[face]
    v = (column + rng.random(total, dtype=np.float32)) / cells_b[face]
    # Half a voxel off the origin keeps the floor and two walls mid-voxel instead of on a boundary.
    origin = faces.origin * scale + voxel_size / 2
    points = np.empty((total, 3), np.float32)
    for axis in range(3):  # one axis at a time keeps temporaries at [M] instead of [M, 3]
        points[:, axis] = origin[face, axis] + u * edge_a[face, axis] + v * edge_b[face, axis]
    return points, faces.label[face].astype(np.int32)


# --------------------------------------------------------------------------------------------
# Outdoor LiDAR


def outdoor_lidar(num_voxels: int = 100_000, seed: int = 0, voxel_size: float = 0.05) -> Scene:
    """Rotating 64-beam LiDAR sweeps of a street: road, sidewalks, terrain, parked and oncoming
    cars, poles and buildings, ray-cast analytically with small range noise.

    One full-resolution sweep gives about 90K voxels at 5 cm, 55K at 10 cm. Smaller targets use
    fewer azimuth columns; larger ones accumulate sweeps taken every `SWEEP_SPACING_M` along the
    road. The range limit, the same for every sweep, is then lowered just enough to keep exactly
    `num_voxels` voxels (ties aside).
    """
    _check_num_voxels(num_voxels, 1)
    _check_seed(seed)
    _check_voxel_size(voxel_size)
    low, high = LIDAR_VOXEL_SIZE_RANGE_M
    if not low <= voxel_size <= high:
        raise ValueError(f"voxel_size must be between {low} and {high} m for outdoor_lidar, "
                         f"got {voxel_size}")
    street = _Street(seed)
    columns = LIDAR_COLUMNS
    sweeps = [_lidar_sweep(street, 0, columns, seed)]
    count = _count_voxels(sweeps[0][0], voxel_size)
    if count > 2 * num_voxels:
        # Fewer columns keep the scan's extent, where cropping the range alone keeps only the
        # nearest rings; returns (hence voxels) drop at most in proportion to the columns.
        columns = max(LIDAR_MIN_COLUMNS, round(columns * 1.5 * num_voxels / count))
        sweeps = [_lidar_sweep(street, 0, columns, seed)]
        count = _count_voxels(sweeps[0][0], voxel_size)
    added, previous_count = 1, 0
    while count < num_voxels:
        # Each sweep adds fewer new voxels than the last (it overlaps more of the earlier ones):
        # extrapolate from the latest, with a margin.
        new_voxels_per_sweep = max(1.0, (count - previous_count) / added)
        missing = num_voxels - count
        added = 1 if len(sweeps) == 1 else math.ceil(1.2 * missing / new_voxels_per_sweep)
        if len(sweeps) + added > MAX_SWEEPS:
            raise ValueError(f"num_voxels={num_voxels} needs more than {MAX_SWEEPS} sweeps at "
                             f"voxel_size={voxel_size}")
        sweeps += [_lidar_sweep(street, k, columns, seed)
                   for k in range(len(sweeps), len(sweeps) + added)]
        previous_count = count
        count = _count_voxels(np.concatenate([s[0] for s in sweeps]), voxel_size)

    points, labels, ranges = (np.concatenate(parts) for parts in zip(*sweeps))
    keys = _voxel_keys(points, voxel_size)[0]
    by_voxel = np.argsort(keys)
    voxel_starts = np.flatnonzero(_first_of_runs(keys[by_voxel]))
    voxel_range = np.minimum.reduceat(ranges[by_voxel], voxel_starts)  # nearest return per voxel
    range_limit = np.partition(voxel_range, num_voxels - 1)[num_voxels - 1]
    keep = ranges <= range_limit
    points, labels = points[keep], labels[keep]
    _check_size(int(np.count_nonzero(voxel_range <= range_limit)), num_voxels, "outdoor_lidar")
    origins = np.array([_sensor_origin(k) for k in range(len(sweeps))], np.float32)
    return Scene("outdoor_lidar", points, labels, OUTDOOR_CLASSES, float(voxel_size), origins)


def _sensor_origin(sweep: int) -> np.ndarray:
    return np.array([sweep * SWEEP_SPACING_M, EGO_LANE_Y_M, LIDAR_SENSOR_HEIGHT_M])


class _Street:
    """A straight street generated segment by segment from the seed, so that its objects do not
    depend on how far the ego drives. Boxes are rows as in the room; poles are rows
    (centre x, y, radius, height)."""

    def __init__(self, seed: int):
        self._seed = seed
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def objects_near(self, x: float, reach: float) -> tuple[np.ndarray, np.ndarray]:
        first = math.floor((x - reach - STREET_START_M) / STREET_SEGMENT_M)
        last = math.floor((x + reach - STREET_START_M) / STREET_SEGMENT_M)
        for index in range(first, last + 1):
            if index not in self._segments:
                self._segments[index] = self._segment(index)
        boxes, poles = zip(*(self._segments[index] for index in range(first, last + 1)))
        return np.concatenate(boxes), np.concatenate(poles)

    def _segment(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self._seed, 2, index])
        start = STREET_START_M + index * STREET_SEGMENT_M
        end = start + STREET_SEGMENT_M
        boxes, poles = [], []
        # Objects never cross the segment's end, so a segment holds everything within it.
        lanes = [(side * (LANE_WIDTH_M + PARKING_WIDTH_M / 2), (0.8, 10.0)) for side in (-1, 1)]
        lanes.append((LANE_WIDTH_M / 2, (8.0, 40.0)))  # oncoming traffic; the ego lane stays clear
        for lane_y, gap in lanes:
            x = start + rng.uniform(*gap) / 2
            while True:
                car, length = _car(rng)
                if x + length > end:
                    break
                y, yaw = lane_y + rng.normal(0, 0.1), rng.normal(0, 0.03)
                boxes.append(_place(car, x + length / 2, y, yaw))
                x += length + rng.uniform(*gap)
        for side in (-1, 1):
            x = start + rng.uniform(0, 15)
            while x < end:
                radius, height = rng.uniform(0.08, 0.15), rng.uniform(4, 9)
                poles.append([x, side * (ROAD_HALF_WIDTH_M + 0.4), radius, height])
                x += rng.uniform(10, 30)
            x = start
            while end - x > 2:
                length = min(rng.uniform(8, 30), end - x)
                near = SIDEWALK_OUTER_M + rng.uniform(0.5, 6)
                far = near + rng.uniform(8, 15)
                y0, y1 = (near, far) if side > 0 else (-far, -near)
                height = rng.uniform(5, 20)
                boxes.append(np.array([_box(x, x + length, y0, y1, 0.0, height, BUILDING)]))
                x += length + (rng.uniform(2, 10) if rng.random() < 0.4 else 0.0)
        return np.concatenate(boxes), np.array(poles).reshape(-1, 4)


def _car(rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """A car body with a narrower cabin on top, centred on the origin, and its length."""
    length, width, height = rng.uniform(3.8, 4.9), rng.uniform(1.7, 2.0), rng.uniform(1.4, 1.7)
    body_top = rng.uniform(0.85, 1.0)
    return np.array([
        _box(-length / 2, length / 2, -width / 2, width / 2, 0.2, body_top, CAR),
        _box(-0.3 * length, 0.25 * length, -0.45 * width, 0.45 * width, body_top, height, CAR),
    ]), length


def _lidar_sweep(street: _Street, sweep: int, columns: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sweep from the `sweep`-th ego position: points float32 [n, 3], labels, ranges."""
    rng = np.random.default_rng([seed, 3, sweep])
    origin = _sensor_origin(sweep)
    elevation = np.deg2rad(np.linspace(*LIDAR_ELEVATION_DEG, LIDAR_BEAMS))[:, None]
    first_azimuth = rng.uniform(0, 2 * np.pi / columns)  # sweeps do not repeat the same azimuths
    azimuth = first_azimuth + 2 * np.pi / columns * np.arange(columns)
    directions = np.stack([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth),
                           np.broadcast_to(np.sin(elevation), (LIDAR_BEAMS, columns))], axis=-1)

    distance = np.full((LIDAR_BEAMS, columns), np.inf)
    label = np.full((LIDAR_BEAMS, columns), -1, np.int32)
    downward = directions[..., 2] < 0
    distance[downward] = -origin[2] / directions[..., 2][downward]
    label[downward] = ROAD  # every ground hit; split into road, sidewalk and terrain below

    boxes, poles = street.objects_near(origin[0], LIDAR_MAX_RANGE_M)
    # (shape, bounding vertical cylinder: centre, radius, bottom, top, ray test, label)
    objects = [(box, box[:2], math.hypot(box[3], box[4]), box[2] - box[5], box[2] + box[5],
                _ray_box_distance, int(box[7])) for box in boxes]
    objects += [(pole, pole[:2], pole[2], 0.0, pole[3], _ray_pole_distance, POLE) for pole in poles]
    for shape, centre, radius, bottom, top, ray_distance, shape_label in objects:
        view = _rays_in_view(origin, np.tan(elevation[:, 0]), first_azimuth, columns,
                             centre, radius, bottom, top)
        if view is None:
            continue
        hit = ray_distance(origin, directions[view], shape)
        closer = hit < distance[view]
        distance[view] = np.where(closer, hit, distance[view])
        label[view] = np.where(closer, shape_label, label[view])

    measured = distance + rng.normal(0, LIDAR_RANGE_NOISE_M, distance.shape)
    returned = (label >= 0) & (measured <= LIDAR_MAX_RANGE_M)
    ranges = measured[returned]
    points = (origin + ranges[:, None] * directions[returned]).astype(np.float32)
    label = label[returned]
    across = np.abs(points[:, 1])
    ground = label == ROAD
    label[ground & (across > ROAD_HALF_WIDTH_M)] = SIDEWALK
    label[ground & (across > SIDEWALK_OUTER_M)] = TERRAIN
    return points, label, ranges


def _rays_in_view(origin: np.ndarray, elevation_tangent: np.ndarray, first_azimuth: float,
                  columns: int, centre: np.ndarray, radius: float, bottom: float,
                  top: float) -> tuple[slice, np.ndarray | slice] | None:
    """Index (beams, columns) of the rays that can meet a shape inside the vertical cylinder
    (centre, radius, bottom, top); None when none can. Culling keeps a sweep's cost near one
    ray test per ray instead of one per ray and object."""
    offset = centre - origin[:2]
    distance = math.hypot(*offset)
    nearest, farthest = max(distance - radius, 0.0), min(distance + radius, LIDAR_MAX_RANGE_M)
    if nearest > LIDAR_MAX_RANGE_M:
        return None
    # A beam's height over horizontal distances [nearest, farthest] must reach [bottom, top].
    rise_near, rise_far = nearest * elevation_tangent, farthest * elevation_tangent
    lowest = origin[2] + np.minimum(rise_near, rise_far)
    highest = origin[2] + np.maximum(rise_near, rise_far)
    # Contiguous: a beam's heights are monotonic in its elevation.
    beams = np.flatnonzero((highest >= bottom) & (lowest <= top))
    if len(beams) == 0:
        return None
    beams = slice(beams[0], beams[-1] + 1)
    if distance <= radius:
        return beams, slice(None)
    half_angle = math.asin(radius / distance)
    bearing = math.atan2(offset[1], offset[0]) - first_azimuth
    step = 2 * np.pi / columns
    first = math.floor((bearing - half_angle) / step)
    last = math.ceil((bearing + half_angle) / step)
    if last - first + 1 >= columns:
        return beams, slice(None)
    return beams, np.arange(first, last + 1) % columns


def _ray_box_distance(origin: np.ndarray, directions: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Distance along each ray to the box (slab test in the box's frame), inf on a miss."""
    cos, sin = math.cos(box[6]), math.sin(box[6])
    relative = origin - box[:3]
    start = (cos * relative[0] + sin * relative[1], -sin * relative[0] + cos * relative[1],
             relative[2])
    step = (cos * directions[..., 0] + sin * directions[..., 1],
            -sin * directions[..., 0] + cos * directions[..., 1], directions[..., 2])
    with np.errstate(divide="ignore", invalid="ignore"):  # rays parallel to a slab
        entry = [np.minimum((-box[3 + a] - start[a]) / step[a], (box[3 + a] - start[a]) / step[a])
                 for a in range(3)]
        leave = [np.maximum((-box[3 + a] - start[a]) / step[a], (box[3 + a] - start[a]) / step[a])
                 for a in range(3)]
    near = np.maximum(np.maximum(entry[0], entry[1]), entry[2])
    far = np.minimum(np.minimum(leave[0], leave[1]), leave[2])
    return np.where((near <= far) & (near > 0), near, np.inf)


def _ray_pole_distance(origin: np.ndarray, directions: np.ndarray, pole: np.ndarray) -> np.ndarray:
    """Distance along each ray to the side of a vertical cylinder standing on the ground, inf on a
    miss (the beams never rise to a pole's top within range)."""
    start_x, start_y = origin[0] - pole[0], origin[1] - pole[1]
    step_x, step_y = directions[..., 0], directions[..., 1]
    a = step_x**2 + step_y**2
    half_b = start_x * step_x + start_y * step_y
    c = start_x**2 + start_y**2 - pole[2] ** 2
    discriminant = half_b**2 - a * c
    distance = (-half_b - np.sqrt(np.maximum(discriminant, 0))) / a
    height = origin[2] + distance * directions[..., 2]
    hit = (discriminant >= 0) & (distance > 0) & (height >= 0) & (height <= pole[3])
    return np.where(hit, distance, np.inf)


# --------------------------------------------------------------------------------------------
# Shared helpers


def _voxel_keys(points: np.ndarray, voxel_size: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One int64 key per point packing floor(points / voxel_size), with the unpacking's lowest
    coordinate and extent per axis."""
    coords = np.floor(points / voxel_size).astype(np.int64)
    if len(coords) == 0:
        return np.zeros(0, np.int64), np.zeros(3, np.int64), np.ones(3, np.int64)
    low = coords.min(axis=0)
    coords -= low
    extent = coords.max(axis=0) + 1
    return (coords[:, 0] * extent[1] + coords[:, 1]) * extent[2] + coords[:, 2], low, extent


def _first_of_runs(sorted_values: np.ndarray) -> np.ndarray:
    """Mask of the first element of each run of equal values."""
    first = np.ones(len(sorted_values), bool)
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=first[1:])
    return first


def _unique(keys: np.ndarray) -> np.ndarray:
    """Sorted unique keys; `np.unique` is many times slower than sorting on NumPy 2.4."""
    keys = np.sort(keys)
    return keys[_first_of_runs(keys)]


def _count_voxels(points: np.ndarray, voxel_size: float) -> int:
    return int(_first_of_runs(np.sort(_voxel_keys(points, voxel_size)[0])).sum())


def _check_size(count: int, num_voxels: int, builder: str) -> None:
    if abs(count - num_voxels) > SIZE_TOLERANCE * num_voxels:
        raise RuntimeError(f"{builder} reached {count} voxels for num_voxels={num_voxels}")


def _check_num_voxels(num_voxels: int, minimum: int) -> None:
    if isinstance(num_voxels, bool) or not isinstance(num_voxels, Integral):
        raise TypeError(f"num_voxels must be an int, got {type(num_voxels).__name__}")
    if not minimum <= num_voxels <= MAX_NUM_VOXELS:
        raise ValueError(f"num_voxels must be between {minimum} and {MAX_NUM_VOXELS}, "
                         f"got {num_voxels}")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")


def _check_voxel_size(voxel_size: float) -> None:
    if isinstance(voxel_size, bool) or not isinstance(voxel_size, Real):
        raise TypeError(f"voxel_size must be a number, got {type(voxel_size).__name__}")
    if not (math.isfinite(voxel_size) and voxel_size > 0):
        raise ValueError(f"voxel_size must be positive and finite, got {voxel_size}")
