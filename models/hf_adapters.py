"""The registry of Hugging Face adapters: a model family's `HFAdapter` (checkpoint/hf_adapter_protocol.py) by our
`model.name` or by HF's `config.json` `model_type`. The application layer (the trainer, `python -m
checkpoint.convert`) looks an adapter up here and hands it to the checkpoint package, which never
imports a family. Adding a family is adding its adapter and its names here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .llama3.hf_adapter import LLAMA3_HF_ADAPTER
from .qwen3.hf_adapter import QWEN3_HF_ADAPTER

if TYPE_CHECKING:
    from checkpoint.hf_adapter_protocol import HFAdapter

# our model.name and HF's model_type -> the family's adapter
_ADAPTERS: dict[str, HFAdapter[Any]] = {
    "llama3": LLAMA3_HF_ADAPTER,
    "llama": LLAMA3_HF_ADAPTER,
    "qwen3": QWEN3_HF_ADAPTER,  # our model.name, and HF's model_type of the dense models
    "qwen3_moe": QWEN3_HF_ADAPTER,  # HF's model_type of the MoE models
}


def hf_adapter_names() -> list[str]:
    """Every name `hf_adapter` knows (model.name values and HF model_type values), sorted."""
    return sorted(_ADAPTERS)


def hf_adapter(model_type_or_name: str) -> HFAdapter[Any]:
    """The HF adapter of the family named `model_type_or_name`: our model.name ("llama3") or HF's
    model_type ("llama"). ValueError listing the known names for any other."""
    adapter = _ADAPTERS.get(model_type_or_name)
    if adapter is None:
        raise ValueError(
            f"no Hugging Face adapter for {model_type_or_name!r}: known model.name / model_type values are "
            f"{hf_adapter_names()}; a new model family adds its adapter in models/hf_adapters.py"
        )
    return adapter
