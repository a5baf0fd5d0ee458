"""What the Hugging Face conversion needs of a model family: the `HFAdapter` protocol.

The conversion (`checkpoint.hf_conversion`, `checkpoint.hf_state`) is generic: it streams tensors,
shards files, reads boxes and commits folders. Everything that depends on the family (parameter names
on both sides, the layout transforms of some tensors, `config.json` <-> model args, the flavors) is
asked of an adapter object that the caller hands in. A family provides one next to its model
(Llama's: `models/llama3/hf_adapter.py`); `models.hf_adapters.hf_adapter(name)` finds it by our
`model.name` or by HF's `model_type`. Nothing under checkpoint/ imports a family: adding one is adding
its adapter.

The members are exactly what the conversion calls; names are our FQNs below "model." (torchtitan's)
and HF's parameter names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar

import torch


class ModelArgs(Protocol):
    """What the conversion reads of a family's model args, which are a dataclass (it also derives args
    with `dataclasses.replace`)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    n_layers: int
    vocab_size: int
    max_seq_len: int

    @property
    def tie_word_embeddings(self) -> bool: ...


ArgsT = TypeVar("ArgsT", bound=ModelArgs)


class HFAdapter(Protocol[ArgsT]):
    """One model family <-> its Hugging Face hub format (see the module docstring)."""

    @property
    def name(self) -> str:
        """Our `model.name` of the family ("llama3"), recorded in the metadata of from-hf's checkpoints."""
        ...

    @property
    def hf_architecture(self) -> str:
        """HF's model class ("LlamaForCausalLM"), named where a tensor name is not one of its parameters."""
        ...

    @property
    def flavors(self) -> Mapping[str, ArgsT]:
        """Flavor name -> model args (to-hf of a checkpoint whose metadata names only a flavor)."""
        ...

    @property
    def output_fqn(self) -> str:
        """Our output projection ("output.weight"): absent from a tied model's state dict."""
        ...

    @property
    def embedding_fqn(self) -> str:
        """Our token embedding ("tok_embeddings.weight"): its rows are the vocabulary."""
        ...

    @property
    def ignored_hf_suffixes(self) -> tuple[str, ...]:
        """Endings of HF tensor names that are derived buffers, never weights (skipped when reading)."""
        ...

    @property
    def hf_config_ambiguous_args(self) -> frozenset[str]:
        """Model-args fields that several values spell for one `config.json` (Llama's FFN width: multiple_of,
        ffn_dim_multiplier); left out when a folder's args are compared with a job's (the shapes check them)."""
        ...

    def to_hf_name(self, fqn: str) -> str:
        """Our FQN -> HF's parameter name."""
        ...

    def from_hf_name(self, name: str) -> str:
        """HF's parameter name -> our FQN; KeyError for a name the family does not have."""
        ...

    def stacked_hf_names(self, fqn: str, args: ArgsT) -> list[str] | None:
        """The HF names whose stack along a new dim 0 is our `fqn`, in order (an MoE's experts: we hold one
        (E, ...) tensor, the hub format one tensor per expert); None where one HF tensor is ours (`to_hf_name`)."""
        ...

    def not_in_hf(self, fqn: str, args: ArgsT) -> bool:
        """Whether our state tensor `fqn` has no place in HF's format (Qwen3-MoE's routing bias: HF routes without
        one). Reading HF leaves it at zero; writing HF refuses a non-zero one, whose effect would be lost."""
        ...

    def layer_of(self, fqn: str) -> int | None:
        """The block number of an FQN, None outside the blocks."""
        ...

    def to_hf_tensor(self, fqn: str, w: torch.Tensor, args: ArgsT) -> torch.Tensor:
        """Our parameter `fqn` as HF stores it (`w` itself where the layouts agree)."""
        ...

    def from_hf_tensor(self, fqn: str, w: torch.Tensor, args: ArgsT) -> torch.Tensor:
        """HF's tensor for our `fqn` in our layout: the inverse of `to_hf_tensor`."""
        ...

    def rotary_head_dim(self, fqn: str, args: ArgsT) -> int | None:
        """The rows of one head when HF's layout of `fqn` permutes rows within each head (Llama's wq / wk:
        the rotary pairs), else None (the same layout on both sides)."""
        ...

    def permute_from_hf(self, w: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Rows of `n_heads` whole heads of such a tensor from HF's layout to ours (a box of a sharded load)."""
        ...

    def hf_config(self, args: ArgsT, *, dtype: str, tie_word_embeddings: bool) -> dict[str, Any]:
        """The `config.json` of the model `args` stored in `dtype`."""
        ...

    def args_from_hf_config(self, config: dict[str, Any]) -> ArgsT:
        """Our model args for HF's `config.json`; ValueError naming what our model cannot express."""
        ...

    def closest_flavor(self, args: ArgsT) -> str:
        """The flavor whose weights and numerics `args` has, or "custom"."""
        ...

    def model_args_to_json(self, args: ArgsT) -> dict[str, Any]:
        """`args` as a checkpoint's metadata stores them ("model_args")."""
        ...

    def model_args_from_json(self, raw: dict[str, Any]) -> ArgsT:
        """The inverse of `model_args_to_json`; TypeError naming unknown fields."""
        ...

    def parameter_shapes(self, args: ArgsT, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
        """Our FQN -> global shape of every parameter, in HF's file order; without the output projection when
        `output` is false (by default when `args` ties it to the embedding)."""
        ...
