"""Offline conversion of HF MoE checkpoints to NVFP4, and inspection/repair of NVFP4 checkpoints."""

from .convert import ConvertOptions, ConvertSummary, convert_checkpoint
from .inspect import InspectReport, Problem, fix_checkpoint, inspect_checkpoint
from .plan import Selection
from .quant_config import QuantSettings
from .source import ConversionError

__all__ = [
    "ConversionError",
    "ConvertOptions",
    "ConvertSummary",
    "InspectReport",
    "Problem",
    "QuantSettings",
    "Selection",
    "convert_checkpoint",
    "fix_checkpoint",
    "inspect_checkpoint",
]
