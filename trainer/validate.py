"""Validation: the model's mean token loss on held-out data, every `validation.freq` steps.

Held-out data (`build_held_out_windows`), cut into seq_len+1 windows by the training data machinery
(trainer/data.py), read once per evaluation:
- "embedded" (the default): trainer/corpus/validation.txt, 40 documents generated like the training
  corpus (trainer/corpus/corpus.txt) but none of them in it, nor any of their composed sentences
  (tests/trainer/test_validate.py checks it). A second seed over corpus.txt would not be held out:
  every seed cuts the same tokens into the same windows, only in another order.
- `validation.dataset_path`: local files, streamed as `training.dataset_path` is; it must not be the
  training path (the pre-flight refuses it).
Hub datasets are refused: data.py reads a hub set's split "train" only, the training data.

The loss is the global mean over target tokens, like the training loss: the sum of token losses on
every dp rank over the global count of targets (not a mean of per-batch means), under no_grad with
the model in eval mode. A validation batch is local_batch_size sequences per dp rank; the last one
of a pass is padded with ignored targets, so `steps = -1` counts every window exactly once and gives
the same loss on any dp degree and batch size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from parallelisms.context_parallel import SequenceSharding
from parallelisms.dtensor import DeviceMesh, DTensor, Partial

from .data import (
    CORPUS_PATH,
    DocumentStream,
    ShuffledWindows,
    StreamedWindows,
    WindowSource,
    load_tokens,
    local_documents,
)
from .token_loss import IGNORE_INDEX, token_loss_sum
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

VALIDATION_CORPUS_PATH = CORPUS_PATH.parent / "validation.txt"


class ScalarWriter(Protocol):
    """What validation needs of a TensorBoard SummaryWriter."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


# ----------------------------------------------------------------------------------- held-out data
def build_held_out_windows(
    dataset: str, tokenizer: Tokenizer, *, dataset_path: str, text_field: str, seq_len: int, seed: int
) -> WindowSource:
    """A window source yielding one (1, seq_len + 1) window per "global batch"; `one_pass` reads it once."""
    if dataset_path:
        documents = local_documents(dataset_path, text_field, key="validation.dataset_path")
        stream = DocumentStream(documents, tokenizer, name=dataset_path)
        windows = StreamedWindows(stream, seq_len=seq_len, global_batch_size=1)
        if next(one_pass(windows), None) is None:  # at start, not at the first validation validation.freq steps in
            raise ValueError(
                f"validation.dataset_path={dataset_path!r} holds fewer than seq_len + 1 = {seq_len + 1} tokens, not "
                f"one validation sequence; add held-out text, or lower validation.seq_len"
            )
        return windows
    if dataset == "embedded":
        tokens = load_tokens(tokenizer, VALIDATION_CORPUS_PATH)
        return ShuffledWindows(tokens, seq_len=seq_len, global_batch_size=1, seed=seed, name="embedded-validation")
    raise ValueError(
        f"validation.dataset={dataset!r}: hub datasets are not read for validation (the loader reads their split "
        f"'train', the training data); set validation.dataset_path to local held-out files, or use 'embedded'"
    )


def one_pass(source: WindowSource) -> Iterator[torch.Tensor]:
    """Every window of `source` once, each (seq_len + 1,): the in-memory corpus for one epoch, a stream
    until it would wrap into its next epoch (the window that crosses the seam is dropped)."""
    limit = source.batches_per_epoch if isinstance(source, ShuffledWindows) else None
    for i, (window, after) in enumerate(source.global_batches(0, source.start_cursor())):
        if (limit is not None and i >= limit) or after.get("epoch", 0) > 0:
            return
        yield window[0]  # (T + 1,)


def validation_batches(
    windows: Iterable[torch.Tensor], *, local_batch_size: int, dp_rank: int, dp_size: int, steps: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, labels) of each global batch of local_batch_size x dp_size windows, at most
    `steps` batches (-1: all). A short last batch is padded with rows whose labels are all IGNORE_INDEX,
    so every rank runs the same number of forwards (FSDP's collectives) and each window counts once."""
    global_batch = local_batch_size * dp_size
    it, done = iter(windows), 0
    while steps < 0 or done < steps:
        rows = [w for _, w in zip(range(global_batch), it, strict=False)]
        if not rows:
            return
        batch = torch.stack(rows)  # (g, T + 1), g <= G
        inputs, labels = batch[:, :-1], batch[:, 1:]  # (g, T), (g, T)
        if len(rows) < global_batch:
            pad = global_batch - len(rows)
            inputs = torch.cat([inputs, inputs.new_zeros(pad, inputs.shape[1])])  # (G, T)
            labels = torch.cat([labels, labels.new_full((pad, labels.shape[1]), IGNORE_INDEX)])  # (G, T)
        mine = slice(dp_rank * local_batch_size, (dp_rank + 1) * local_batch_size)
        yield inputs[mine].contiguous(), labels[mine].contiguous()  # (B, T), (B, T)
        done += 1


# ---------------------------------------------------------------------------------------- the loss
TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, labels) -> summed token loss


@dataclass(frozen=True)
class ValidationResult:
    loss: float  # global mean token loss
    batches: int  # validation batches (forwards per rank)
    targets: int  # target tokens counted over every dp rank


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    dp_mesh: DeviceMesh | None,
    use_loss_parallel: bool,
    autocast: torch.dtype | None = None,
    token_loss: TokenLoss | None = None,
) -> ValidationResult:
    """The global mean token loss of `model` over `batches` (this rank's part of each), in eval mode
    (restored after). The token-loss sum and target count are summed over `dp_mesh` in one all-reduce;
    under loss parallelism the loss is computed on vocabulary-sharded logits. `autocast`: the forward
    in that dtype, as training's (mixed precision without FSDP). `token_loss(inputs, labels)` replaces the
    forward and loss (a pipeline's forward-only schedule)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (token-loss sum, target count)
    n = 0
    try:
        for inputs, labels in batches:
            inputs, labels = inputs.to(device), labels.to(device)
            if token_loss is not None:
                token_sum = token_loss(inputs, labels)
            else:
                token_sum = token_loss_sum(model, inputs, labels, autocast=autocast, vocab_parallel=use_loss_parallel)
            if isinstance(token_sum, DTensor):
                token_sum = token_sum.full_tensor()
            totals += torch.stack([token_sum.double(), (labels != IGNORE_INDEX).sum().double()])
            n += 1
    finally:
        model.train(was_training)
    if dp_mesh is not None:
        totals = DTensor.from_local(totals, dp_mesh, [Partial("sum")]).full_tensor()
    token_sum_total, count = totals.tolist()
    if count == 0:
        raise ValueError("the validation data gave no target tokens; lower validation.seq_len or check its files")
    return ValidationResult(loss=token_sum_total / count, batches=n, targets=int(count))


# --------------------------------------------------------------------------------------- component
class Validator:
    """Decides when to validate (`should_validate`) and does it: evaluate, log one line, write
    `validation_metrics/loss` to TensorBoard when given a writer (rank 0's)."""

    def __init__(
        self,
        source: WindowSource,
        *,
        freq: int,
        steps: int,
        local_batch_size: int,
        last_step: int,
        dp_rank: int,
        dp_size: int,
        dp_mesh: DeviceMesh | None,
        use_loss_parallel: bool,
        device: torch.device,
        writer: ScalarWriter | None = None,
        autocast: torch.dtype | None = None,
        token_loss: TokenLoss | None = None,
        sequence: SequenceSharding | None = None,
    ) -> None:
        self.token_loss, self.sequence = token_loss, sequence
        self.source, self.freq, self.steps, self.last_step = source, freq, steps, last_step
        self.local_batch_size, self.dp_rank, self.dp_size, self.dp_mesh = local_batch_size, dp_rank, dp_size, dp_mesh
        self.use_loss_parallel, self.device, self.writer, self.autocast = use_loss_parallel, device, writer, autocast

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def validate_if_due(self, model: nn.Module, step: int) -> ValidationResult | None:
        """Validate when `step` is due (every `freq` steps and the last)."""
        return self.validate(model, step) if self.should_validate(step) else None

    def validate(self, model: nn.Module, step: int) -> ValidationResult:
        start = time.perf_counter()
        batches = validation_batches(
            one_pass(self.source), local_batch_size=self.local_batch_size, dp_rank=self.dp_rank,
            dp_size=self.dp_size, steps=self.steps,
        )  # fmt: skip
        if self.sequence is not None:  # context parallelism: this rank's share of each sequence
            sequence = self.sequence
            batches = ((sequence.shard(x), sequence.shard(y)) for x, y in batches)
        result = evaluate(
            model, batches, device=self.device, dp_mesh=self.dp_mesh, use_loss_parallel=self.use_loss_parallel,
            autocast=self.autocast, token_loss=self.token_loss,
        )  # fmt: skip
        logger.info(
            "validate step %d | loss %.4f | batches %d | tokens %s | %.2fs",
            step, result.loss, result.batches, f"{result.targets:,}", time.perf_counter() - start,
        )  # fmt: skip
        if self.writer is not None:
            self.writer.add_scalar("validation_metrics/loss", result.loss, step)
        return result
