"""The embedded dataset: a small English corpus, tokenized once, served as shifted (input, label) batches.

The corpus is split into paragraphs (documents), each framed by BOS/EOS and concatenated into one
token stream, which is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch the windows
are shuffled by (seed, epoch), identically on every rank, and data-parallel rank r of n takes windows
r, r+n, r+2n, ...: dp ranks read disjoint streams, and every rank of one dp group (its TP/CP/PP peers)
reads the same one. The loader loops forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from .tokenizer import ByteTokenizer

CORPUS_PATH = Path(__file__).parent / "corpus" / "corpus.txt"


def load_tokens(tokenizer: ByteTokenizer, path: Path = CORPUS_PATH) -> torch.Tensor:
    """The whole corpus as one int64 token stream, each paragraph framed by BOS/EOS."""
    docs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, bos=True, eos=True)
    return torch.tensor(ids, dtype=torch.long)


class TokenBatches:
    """Infinite iterator of (input, label) int64 batches, each (local_batch_size, seq_len).

    Args:
        tokens: the token stream.
        local_batch_size: sequences per batch on this rank.
        seq_len: tokens per sequence; labels are inputs shifted left by one.
        dp_rank, dp_size: this rank's index on the data-parallel ("dp") mesh dim and its size.
        seed: shuffling seed (same on every rank).
    """

    def __init__(
        self, tokens: torch.Tensor, *, local_batch_size: int, seq_len: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        n_windows = (tokens.numel() - 1) // (seq_len + 1)
        windows_per_rank = n_windows // dp_size
        if windows_per_rank < local_batch_size:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens gives {n_windows} windows of seq_len+1={seq_len + 1}, "
                f"{windows_per_rank} per dp rank (dp_size={dp_size}) < local_batch_size({local_batch_size}); "
                f"lower training.seq_len or training.local_batch_size"
            )
        # (n_windows, seq_len + 1)
        self.windows = tokens[: n_windows * (seq_len + 1)].view(n_windows, seq_len + 1)
        self.local_batch_size, self.dp_rank, self.dp_size, self.seed = local_batch_size, dp_rank, dp_size, seed
        self.batches_per_epoch = windows_per_rank // local_batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = 0
        while True:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.windows.shape[0], generator=g)
            mine = order[self.dp_rank :: self.dp_size]
            for b in range(self.batches_per_epoch):
                idx = mine[b * self.local_batch_size : (b + 1) * self.local_batch_size]
                batch = self.windows[idx]  # (B, T + 1)
                yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T), (B, T)
            epoch += 1


def build_data_loader(
    dataset: str,
    tokenizer: ByteTokenizer,
    *,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> TokenBatches:
    """The loader for `dataset` (only "embedded" exists) on data-parallel rank `dp_rank` of `dp_size`."""
    if dataset != "embedded":
        raise ValueError(f"training.dataset={dataset!r}: only 'embedded' (trainer/corpus/corpus.txt) is available")
    tokens = load_tokens(tokenizer)
    return TokenBatches(
        tokens, local_batch_size=local_batch_size, seq_len=seq_len, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )
