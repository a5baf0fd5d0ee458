"""Llama 3: flavors (args.py), single-device model (model.py), parallelization plan (parallelize.py)."""

from .args import RoPEScalingArgs, TransformerModelArgs, llama3_configs
from .model import Transformer

__all__ = ["RoPEScalingArgs", "Transformer", "TransformerModelArgs", "llama3_configs"]
