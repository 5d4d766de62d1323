"""Small helpers shared by every layer."""

from swarmtrain.utils.gc_tuning import freeze_startup_objects

__all__ = ["freeze_startup_objects"]
