"""The token loss training and validation share: summed, not averaged, so the caller divides by
the global target count (a mean of per-batch means would weigh short batches too much)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.dtensor.traceable import compile_whole
from parallelisms.tensor_parallel import loss_parallel

IGNORE_INDEX = -100  # cross_entropy's default: such targets count neither in the loss nor in its divisor

CrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies of (N, V) float32 logits against (N,) labels, ignore_index excluded."""
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)


def build_cross_entropy(compile_backend: str | None) -> CrossEntropy:
    """The loss function, torch.compile'd whole with `compile_backend` (compile.components has "loss"), under
    loss parallelism too: its vocabulary-sharded logits are DTensors, traced like any (dtensor/traceable.py)."""
    if compile_backend is None:
        return summed_cross_entropy
    return compile_whole(summed_cross_entropy, compile_backend, "the loss")


def token_loss_sum(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    autocast: torch.dtype | None = None,
    vocab_parallel: bool = False,
    cross_entropy: CrossEntropy = summed_cross_entropy,
) -> torch.Tensor:
    """Sum of the token cross-entropies of `model(inputs)` against `labels` (ignore_index
    excluded), in float32; the forward under torch.autocast in `autocast` when given (mixed
    precision without FSDP). With `vocab_parallel` the logits are vocabulary-sharded and the loss
    runs under loss_parallel(), the model's forward not: that context checks every torch call made
    inside it. Run the backward under loss_parallel() too, as torch requires."""
    with torch.autocast(inputs.device.type, autocast) if autocast else contextlib.nullcontext():
        logits = model(inputs)  # (B, T, V)   S(-1) under loss parallelism
    with loss_parallel() if vocab_parallel else contextlib.nullcontext():
        return cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))  # (B*T, V) vs (B*T,)
