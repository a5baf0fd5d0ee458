"""What the trainer's checkpointed states mean to the checkpoint manager, which knows no trainer convention:
the weights are the "model" state, "train_state" makes a checkpoint a resume point, and weights of a Llama
that computes differently from this job's are refused (`check_model_args`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checkpoint.format import CheckpointError
from checkpoint.manager import StateRoles

# Model args the weights do not depend on: the context length (the rotary table is rebuilt for it),
# the vocabulary (its shapes are checked with every tensor), the init scheme, and how attention treats the
# documents packed into a row (causal or block-causal, the EOS that ends one, the kernel): one set of weights
# serves both masks (Llama 3 was pre-trained block-causal).
_SHAPE_OR_INIT_ARGS = frozenset(
    {"max_seq_len", "vocab_size", "depth_init", "attn_mask_type", "use_flex_attn", "eos_id"}
)


def check_model_args(directory: Path, saved: dict[str, Any], ours: dict[str, Any]) -> None:
    """Refuse weights saved by a model that computes differently from this job's (e.g. Llama 3.1's
    RoPE scaling into a flavor without it): the shapes would match and the logits silently not."""
    theirs, mine = saved.get("model_args"), ours.get("model_args")
    if not isinstance(theirs, dict) or not isinstance(mine, dict):
        return  # not saved by the trainer (or by a tool that records no model args): shapes only
    mine = json.loads(json.dumps(mine))  # compare as saved (tuples as lists, dataclasses as dicts)
    shared = sorted((set(theirs) & set(mine)) - _SHAPE_OR_INIT_ARGS)  # a field newer than the checkpoint: skipped
    differ = [k for k in shared if theirs[k] != mine[k]]
    if not differ:
        return
    flavor = saved.get("job_config", {}).get("model", {}).get("flavor")
    details = "; ".join(f"{k}: checkpoint {theirs[k]!r}, this job {mine[k]!r}" for k in differ)
    hint = f" (it was saved as model.flavor={flavor!r})" if flavor else ""
    raise CheckpointError(
        f"{directory} holds a model with other architecture than this job's: {details}. Its weights would "
        f"compute other outputs; set model.flavor to the flavor it was trained as{hint}"
    )


TRAINER_ROLES = StateRoles(model="model", resumable="train_state", compatible=check_model_args)
