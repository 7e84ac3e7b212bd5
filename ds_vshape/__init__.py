"""ds_vshape: modern pipeline-parallel schedules for DeepSpeed."""

__version__ = "0.1.0"

__all__ = ["__version__"]
