"""Data to run on: deterministic synthetic scenes (indoor rooms, outdoor LiDAR sweeps)."""

from cupysparse.data.scenes import INDOOR_CLASSES, OUTDOOR_CLASSES, Scene, indoor_room, make_scene, outdoor_lidar

__all__ = ["INDOOR_CLASSES", "OUTDOOR_CLASSES", "Scene", "indoor_room", "make_scene", "outdoor_lidar"]
