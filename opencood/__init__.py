"""opencood: cooperative 3D object detection on OPV2V-format data."""

__version__ = "0.1.0"
