"""DeepSeek-V3: flavors (args.py), single-device model (model.py), Hugging Face adapter (hf_adapter.py).

The model is imported on first use: the flavors are torch-free, and pre-flight reads them before
any process imports torch.
"""

from typing import TYPE_CHECKING, Any

from .args import DeepSeekV3ModelArgs, deepseek_v3_configs, parameter_shapes

if TYPE_CHECKING:
    from .model import DeepSeekV3Model

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs", "deepseek_v3_configs", "parameter_shapes"]


def __getattr__(name: str) -> Any:
    if name == "DeepSeekV3Model":
        from .model import DeepSeekV3Model

        return DeepSeekV3Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
