"""Data to run on: deterministic synthetic scenes (indoor rooms, outdoor LiDAR sweeps) and point-cloud files
(`read_points`: KITTI .bin, .npy/.npz, .ply, .pcd, .las/.laz)."""

from cupysparse.data.point_clouds import read_points
from cupysparse.data.scenes import INDOOR_CLASSES, OUTDOOR_CLASSES, Scene, indoor_room, make_scene, outdoor_lidar

__all__ = ["INDOOR_CLASSES", "OUTDOOR_CLASSES", "Scene", "indoor_room", "make_scene", "outdoor_lidar", "read_points"]
