"""Splitting a decoder (any family: models/common/decoder.py) into pipeline model parts that keep the global FQNs.

`module_fqns_per_stage` is torchtitan's split (`generate_llm_fqn_per_model_part`): the embedding counts as
`first_stage_less_layers` layers and norm + output as `last_stage_less_layers`, and the effective layers are
spread evenly over the stages, earlier stages taking the remainder. `split_model` keeps one stage's modules
of a (meta) model and drops the others, so `layers.5.attention.wq.weight` is called so on whichever stage
owns it, and every checkpoint is one model. A part's forward reads the previous stage's hidden states (or
the tokens, on the first stage) and returns the next one's (or the logits, on the last).
"""

from __future__ import annotations

import copy

from torch import nn

from .decoder import Decoder
from .stage_split import module_fqns_per_stage

__all__ = ["is_part", "module_fqns_per_stage", "split_model", "tied_across_stages"]


def split_model(model: Decoder, fqns: list[str]) -> Decoder:
    """A copy of `model` (build it on meta) with only the modules `fqns` names; the others become None
    (top-level) or are removed from `layers`, so the parameters keep their global names."""
    known = {"tok_embeddings", "norm", "output", *(f"layers.{name}" for name in model.layers)}
    unknown = sorted(set(fqns) - known)
    if unknown:
        raise ValueError(
            f"module_fqns_per_model_part names {unknown}, which the model does not have; its modules are "
            f"tok_embeddings, layers.0..layers.{len(model.layers) - 1}, norm, output"
        )
    part = copy.deepcopy(model)
    keep = set(fqns)
    # the dropped modules stay, on meta and unregistered, as stand-ins whose init draws what theirs would
    # (Decoder.init_weights): every part then gets the whole model's weights under one seed
    absent: dict[str, nn.Module] = {}
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            absent[name] = getattr(part, name).to_empty(device="meta")
            setattr(part, name, None)
    for name in list(part.layers):
        if f"layers.{name}" not in keep:
            absent[f"layers.{name}"] = part.layers[name].to_empty(device="meta")
            del part.layers[name]
    part.__dict__["pipeline_absent"] = absent
    return part


def tied_across_stages(part: Decoder) -> bool:
    """A part holding one of two tied weights (the embedding or the output) whose twin is on another stage:
    both stages keep a copy, initialized alike, whose gradients the trainer sums before the step."""
    return part.model_args.tie_word_embeddings and (part.tok_embeddings is None) != (part.output is None)


def is_part(module: nn.Module) -> bool:
    """Whether `module` is a pipeline part (some of the embedding, norm or output are absent)."""
    return isinstance(module, Decoder) and None in (module.tok_embeddings, module.norm, module.output)
