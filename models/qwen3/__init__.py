"""Qwen3, dense and MoE: flavors (args.py), single-device model (model.py), the Hugging Face mapping
(hf_adapter.py).

The model is imported on first use: the flavors are torch-free, and pre-flight reads them before
any process imports torch.
"""

from typing import TYPE_CHECKING, Any

from .args import Qwen3ModelArgs, parameter_shapes, qwen3_configs

if TYPE_CHECKING:
    from .model import Qwen3Model

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "parameter_shapes", "qwen3_configs"]


def __getattr__(name: str) -> Any:
    if name == "Qwen3Model":
        from .model import Qwen3Model

        return Qwen3Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
