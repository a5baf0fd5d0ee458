"""The model registry: `model.name` -> the family (docs/architecture.md §8).

A family is its flavors (torch-free args, which the pre-flight reads before any process imports torch) and its
torch side, imported on first use: the model class, the parallelize function and the Hugging Face adapter. Every
family's model is a `Decoder` (models/common/decoder.py), so the pipeline split, FSDP, the FLOPs formula and the
checkpoint are shared. Adding a family is one package and one entry in `FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .deepseek_v3.args import deepseek_v3_configs
from .deepseek_v3.args import parameter_shapes as deepseek_v3_shapes
from .llama3.args import llama3_configs
from .llama3.args import parameter_shapes as llama3_shapes
from .qwen3.args import parameter_shapes as qwen3_shapes
from .qwen3.args import qwen3_configs

if TYPE_CHECKING:
    from checkpoint.hf_adapter_protocol import HFAdapter
    from models.common.decoder import Decoder


@dataclass(frozen=True)
class FamilyParts:
    """A family's torch side."""

    model_class: Callable[[Any], Decoder]
    """The family's model: `model_class(args)` on the current device."""
    parallelize: Callable[..., Any]
    """models/decoder_parallelize.py: parallelize_decoder with the family's block TP plan."""
    hf_adapter: HFAdapter[Any]


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its `model.name`, flavors, Hugging Face `model_type`s and (lazily) its torch side."""

    name: str
    flavors: Mapping[str, Any]
    hf_model_types: tuple[str, ...]
    parameter_shapes: Callable[..., dict[str, tuple[int, ...]]]
    """`shapes(args, *, output=None)`: our FQN -> global shape of every saved tensor (torch-free)."""
    load_parts: Callable[[], FamilyParts]

    @functools.cached_property
    def parts(self) -> FamilyParts:
        return self.load_parts()

    def flavor(self, flavor: str) -> Any:
        """The args of `flavor`; ValueError naming the family's flavors for any other."""
        if flavor not in self.flavors:
            close = difflib.get_close_matches(flavor, list(self.flavors), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"model.flavor={flavor!r} is not a {self.name} flavor{hint}; the {self.name} flavors are "
                f"{list(self.flavors)}"
            )
        return self.flavors[flavor]


def _llama3() -> FamilyParts:
    from .llama3.hf_adapter import LLAMA3_HF_ADAPTER
    from .llama3.model import Transformer
    from .llama3.parallelize import parallelize_llama

    return FamilyParts(Transformer, parallelize_llama, LLAMA3_HF_ADAPTER)


def _qwen3() -> FamilyParts:
    from .qwen3.hf_adapter import QWEN3_HF_ADAPTER
    from .qwen3.model import Qwen3Model
    from .qwen3.parallelize import parallelize_qwen3

    return FamilyParts(Qwen3Model, parallelize_qwen3, QWEN3_HF_ADAPTER)


def _deepseek_v3() -> FamilyParts:
    from .deepseek_v3.hf_adapter import DEEPSEEK_V3_HF_ADAPTER
    from .deepseek_v3.model import DeepSeekV3Model
    from .deepseek_v3.parallelize import parallelize_deepseek_v3

    return FamilyParts(DeepSeekV3Model, parallelize_deepseek_v3, DEEPSEEK_V3_HF_ADAPTER)


FAMILIES: dict[str, ModelFamily] = {
    "llama3": ModelFamily("llama3", llama3_configs, ("llama",), llama3_shapes, _llama3),
    "qwen3": ModelFamily("qwen3", qwen3_configs, ("qwen3", "qwen3_moe"), qwen3_shapes, _qwen3),
    "deepseek_v3": ModelFamily("deepseek_v3", deepseek_v3_configs, ("deepseek_v3",), deepseek_v3_shapes, _deepseek_v3),
}


def model_family(name: str) -> ModelFamily:
    """The family `model.name` names; ValueError naming the known ones for any other."""
    if name not in FAMILIES:
        close = difflib.get_close_matches(name, list(FAMILIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"model.name={name!r} is not a model family here{hint}; the families are {list(FAMILIES)}")
    return FAMILIES[name]


def family_of_hf_model_type(model_type: str) -> ModelFamily:
    """The family that reads Hugging Face's `model_type` (config.json); ValueError naming the supported ones."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = [t for f in FAMILIES.values() for t in f.hf_model_types]
    raise ValueError(
        f"config.json's model_type {model_type!r} is not supported: meshtrain reads {known} (families {list(FAMILIES)})"
    )


def flavor_args(name: str, flavor: str) -> Any:
    """The args of `model.name`'s `model.flavor` (ValueError naming the known families or flavors)."""
    return model_family(name).flavor(flavor)


def job_model_args(name: str, flavor: str, **overrides: Any) -> Any:
    """The flavor's args with `overrides` (the job's vocab_size, max_seq_len, ...): a copy, the flavor stays."""
    return dataclasses.replace(model_family(name).flavor(flavor), **overrides)


# ------------------------------------------------------------------------- shapes (torch-free)
def moe_args_of(args: Any) -> Any | None:
    """The MoE args of a family's args with MoE layers (models/common/moe_args.py), else None."""
    moe = getattr(args, "moe_args", None)
    if moe is None or not getattr(args, "moe_enabled", True):
        return None
    return moe if n_moe_layers(args) else None


def n_moe_layers(args: Any) -> int:
    """How many blocks are MoE blocks: every block of a Qwen3 MoE flavor, those after DeepSeek's dense ones."""
    if getattr(args, "moe_args", None) is None or not getattr(args, "moe_enabled", True):
        return 0
    return args.n_layers - getattr(args, "n_dense_layers", 0)


def tensor_parallel_dims(args: Any) -> dict[str, tuple[int, str]]:
    """The sizes tensor parallelism splits evenly, with why: {args field: (size, reason)}."""
    heads = "each TP rank holds whole heads"
    dims = {"n_heads": (args.n_heads, heads)}
    if getattr(args, "n_kv_heads", None):
        dims["n_kv_heads"] = (args.n_kv_heads, heads)
    if moe_args_of(args) is not None:
        dims["moe_inter_dim"] = (args.moe_inter_dim, "each TP rank holds a slice of every expert's hidden dim")
    return dims


def attention_head_dim(args: Any) -> int:
    """The head width of the FLOPs formula's attention term: head_dim, or (q/k + v) / 2 for DeepSeek's latent
    attention, whose scores are qk_nope + qk_rope wide and values v_head_dim."""
    if hasattr(args, "qk_nope_head_dim"):
        return (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) // 2
    return int(args.head_dim)


def flops_per_token(name: str, args: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the active non-embedding parameters (forward + backward; Kaplan et al. 2020),
    routed experts counted top_k / num_experts, plus attention scores and values, 12 x L x H x Q x T (torchtitan's,
    PaLM appendix B), for the model `args` of family `name`, from its global shapes."""
    moe = getattr(args, "moe_args", None)
    active = 0.0
    for fqn, shape in model_family(name).parameter_shapes(args).items():
        if fqn == "tok_embeddings.weight" or fqn.endswith(("expert_bias", "tokens_per_expert")):
            continue
        share = moe.top_k / moe.num_experts if moe is not None and ".moe.experts." in fqn else 1.0
        active += math.prod(shape) * share
    return 6 * active + 12 * args.n_layers * args.n_heads * attention_head_dim(args) * seq_len
