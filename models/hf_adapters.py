"""Hugging Face adapters by name: a model family's `HFAdapter` (checkpoint/hf_adapter_protocol.py) by our
`model.name` or by HF's `config.json` `model_type`, from the model registry (models/registry.py). The application
layer (the trainer, `python -m checkpoint.convert`) looks an adapter up here and hands it to the checkpoint package,
which never imports a family."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .registry import FAMILIES

if TYPE_CHECKING:
    from checkpoint.hf_adapter_protocol import HFAdapter


def hf_adapter_names() -> list[str]:
    """Every name `hf_adapter` knows (model.name values and HF model_type values), sorted."""
    return sorted({*FAMILIES, *(t for family in FAMILIES.values() for t in family.hf_model_types)})


def hf_adapter(model_type_or_name: str) -> HFAdapter[Any]:
    """The HF adapter of the family named `model_type_or_name`: our model.name ("llama3") or HF's
    model_type ("llama"). ValueError listing the known names for any other."""
    for family in FAMILIES.values():
        if model_type_or_name == family.name or model_type_or_name in family.hf_model_types:
            return family.parts.hf_adapter
    raise ValueError(
        f"no Hugging Face adapter for {model_type_or_name!r}: known model.name / model_type values are "
        f"{hf_adapter_names()}; a new model family adds its entry in models/registry.py"
    )
