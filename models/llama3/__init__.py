"""Llama 3: flavors (args.py), single-device model (model.py), parallelization plan (parallelize.py).

The model is imported on first use: the flavors are torch-free, and pre-flight reads them before
any process imports torch.
"""

from typing import TYPE_CHECKING, Any

from .args import RoPEScalingArgs, TransformerModelArgs, llama3_configs, parameter_shapes

if TYPE_CHECKING:
    from .model import Transformer

__all__ = ["RoPEScalingArgs", "Transformer", "TransformerModelArgs", "llama3_configs", "parameter_shapes"]


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from .model import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
