"""Interpretability: hook points, per-request capture and steering, steering vectors."""

from .points import BLOCK_POINTS, point_names, resolve_points
from .specs import Capture, resolve_positions
from .vectors import SteeringVector, read_vector_file, write_gguf, write_safetensors

__all__ = ["BLOCK_POINTS", "Capture", "SteeringVector", "point_names", "read_vector_file", "resolve_points",
           "resolve_positions", "write_gguf", "write_safetensors"]
