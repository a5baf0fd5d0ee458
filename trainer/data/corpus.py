"""The embedded corpus (trainer/corpus/corpus.txt): tokenized once in memory and cut into seq_len+1
windows, shuffled by (seed, epoch) each epoch (`ShuffledWindows`). Random access: the position is the
whole state, and a rank's rows are a slice of the global batch (the corpus is small, so every rank
tokenizing all of it costs nothing worth sharding).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..tokenizer import Tokenizer
from .source import Cursor

CORPUS_PATH = Path(__file__).parent.parent / "corpus" / "corpus.txt"


def load_tokens(tokenizer: Tokenizer, path: Path = CORPUS_PATH) -> torch.Tensor:
    """The whole corpus as one int64 token stream, each paragraph framed by BOS/EOS."""
    docs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, bos=True, eos=True)
    return torch.tensor(ids, dtype=torch.long)


class ShuffledWindows:
    """An in-memory token stream cut into windows of seq_len+1, shuffled by (seed, epoch) each epoch."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch_size: int, seed: int, name: str) -> None:
        n_windows = (tokens.numel() - 1) // (seq_len + 1)
        if n_windows < global_batch_size:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens gives {n_windows} windows of seq_len+1={seq_len + 1}, fewer than "
                f"one global batch of {global_batch_size} sequences; lower training.seq_len or the batch size"
            )
        self.windows = tokens[: n_windows * (seq_len + 1)].view(n_windows, seq_len + 1)  # (N, T + 1)
        self.global_batch_size, self.seq_len, self.seed, self.name = global_batch_size, seq_len, seed, name
        self.batches_per_epoch = n_windows // global_batch_size

    def identity(self) -> dict[str, Any]:
        return {"dataset": self.name, "seed": self.seed}

    def start_cursor(self) -> Cursor:
        return {}  # random access: the position is the whole state

    def global_batches(self, position: int, cursor: Cursor) -> Iterator[tuple[torch.Tensor, Cursor]]:
        order, order_epoch = torch.empty(0, dtype=torch.long), -1
        while True:
            epoch, b = divmod(position, self.batches_per_epoch)
            if epoch != order_epoch:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                order, order_epoch = torch.randperm(self.windows.shape[0], generator=g), epoch
            G = self.global_batch_size
            yield self.windows[order[b * G : (b + 1) * G]], {}  # (G, T + 1)
            position += 1

    # RowSource: a rank's rows are a slice of the global batch; the cursor is empty on every rank
    def row_batches(self, position: int, cursor: Cursor, rows: range) -> Iterator[tuple[torch.Tensor, Cursor]]:
        for batch, after in self.global_batches(position, cursor):
            yield batch[rows.start : rows.stop], after  # (G/dp, T + 1)

    def local_cursor(self, cursor: Cursor, rows: range) -> Cursor:
        return {}

    def merge_cursors(self, cursors: list[Cursor]) -> Cursor:
        return {}

    def check_cursor(self, cursor: Any) -> Cursor:
        if cursor not in ({}, None):
            raise ValueError(f"the saved data loader cursor {cursor!r} is a stream's, not the embedded corpus'")
        return {}
