"""The training loader (`TokenBatches`): this data-parallel rank's (input, label) micro-batches of each global
batch, read from a `RowSource` (the embedded corpus, or streamed sources in lanes), with a loader state that
resumes on any data-parallel degree or accumulation split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config.data_files import accumulation_steps
from .corpus import ShuffledWindows
from .documents import DocumentStream
from .lanes import LaneWindows
from .source import RowSource

# every rank's JSON-able object, in rank order (an all-gather over the ranks; the trainer passes one)
GatherState = Callable[[dict[str, Any]], list[dict[str, Any]]]


class TokenBatches:
    """Infinite iterator of (input, label) int64 micro-batches, each (local_batch_size, seq_len).

    The global batch of step k is a function of (data, seed, global_batch_size, seq_len, k) alone:
    the window source's global batch at position k (G = global_batch_size windows). Data-parallel
    rank r produces only its rows [r * G/dp, (r + 1) * G/dp) (a stream: only their documents are
    tokenized, see lanes.py), and yields them as G / (dp_size * local_batch_size) micro-batches in
    order. So any dp degree and any accumulation split of one global batch read the same sequences.

    `state_dict()` is the global position (global batches handed out in full, counted when their
    last micro-batch is) and the source's whole cursor, the same on every rank (each rank's part is
    gathered with `gather_state`): it resumes on any dp degree or accumulation split. A state saved
    with another dataset, weights, seq_len, global batch size or (for the shuffled corpus and a mix)
    seed is refused, since its position would address other data.

    Args:
        data: a token stream (the in-memory corpus, shuffled per epoch), a `DocumentStream`, or several
            to mix with `weights`.
        local_batch_size: sequences per micro-batch on this rank.
        seq_len: tokens per sequence; labels are inputs shifted left by one.
        dp_rank, dp_size: this rank's index on the data-parallel ("dp") mesh dim and its size.
        seed: shuffling seed of the in-memory corpus (same on every rank).
        global_batch_size: sequences per optimizer step over all dp ranks; None: local x dp.
        name: names the data in the state (default: "embedded" for a token stream).
        weights: the mixing weights of several streams (None: equal).
        gather_state: every rank's `local_state_dict()` (an all-gather); needed for `state_dict()` when dp > 1
            with a stream, whose ranks each know only their own rows' cursors.
    """

    def __init__(
        self,
        data: torch.Tensor | DocumentStream | list[DocumentStream],
        *,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        global_batch_size: int | None = None,
        name: str = "embedded",
        weights: list[float] | None = None,
        gather_state: GatherState | None = None,
    ) -> None:
        global_batch = global_batch_size or local_batch_size * dp_size
        self.accumulation_steps = accumulation_steps(global_batch, local_batch_size, dp_size)
        self.source: RowSource
        if isinstance(data, torch.Tensor):
            self.source = ShuffledWindows(data, seq_len=seq_len, global_batch_size=global_batch, seed=seed, name=name)
        else:
            streams = data if isinstance(data, list) else [data]
            self.source = LaneWindows(streams, weights=weights or [1.0] * len(streams), seq_len=seq_len,
                                      global_batch_size=global_batch, seed=seed)  # fmt: skip
        self.local_batch_size, self.dp_rank, self.dp_size, self.seq_len = local_batch_size, dp_rank, dp_size, seq_len
        self.global_batch, self.gather_state = global_batch, gather_state
        per_rank = global_batch // dp_size
        self.rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)  # this rank's rows of a global batch
        self.position, self.cursor = 0, self.source.start_cursor()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        lb = self.local_batch_size
        for mine, cursor in self.source.row_batches(self.position, self.cursor, self.rows):  # (G/dp, T + 1)
            for m in range(self.accumulation_steps):
                if m == self.accumulation_steps - 1:  # before the yield: the consumer may save right after it
                    self.position, self.cursor = self.position + 1, cursor
                rows = mine[m * lb : (m + 1) * lb]  # (B, T + 1)
                yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (B, T), (B, T)

    def _identity(self) -> dict[str, Any]:
        return {**self.source.identity(), "global_batch_size": self.global_batch, "seq_len": self.seq_len}

    def _resume_settings(self, differ: dict[str, tuple[Any, Any]]) -> str:
        """The config keys (and values) that make a saved state with these differences fit this job."""
        keys = {"global_batch_size": "training.global_batch_size", "seq_len": "training.seq_len",
                "seed": "training.seed", "dataset": "training.dataset_path (or training.dataset)",
                "dataset_weights": "training.dataset_weights"}  # fmt: skip
        fixes = [f"{keys.get(k, k)}={saved!r}" for k, (saved, _) in differ.items()]
        saved_batch = differ.get("global_batch_size", (None, None))[0]
        if isinstance(saved_batch, int) and saved_batch % (self.local_batch_size * self.dp_size):
            # the saved batch must still split into micro-batches over this dp degree
            per_rank = saved_batch // self.dp_size if saved_batch % self.dp_size == 0 else 0
            fixes.append(
                f"training.local_batch_size={math.gcd(per_rank, self.local_batch_size)} (it must divide "
                f"{saved_batch} / data-parallel degree {self.dp_size})"
                if per_rank
                else f"a data-parallel degree dividing {saved_batch} (this job's is {self.dp_size})"
            )
        return " and ".join(fixes)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state: the global position and the cursor of its own rows."""
        cursor = self.source.local_cursor(self.cursor, self.rows)
        return {**self._identity(), "position": self.position, "cursor": cursor}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able, the same on every rank: the global position, the source's whole cursor (every rank's
        part, gathered by `gather_state` when dp > 1) and what identifies the data."""
        local = self.local_state_dict()
        states = self.gather_state(local) if self.gather_state is not None and self.dp_size > 1 else [local]
        return merge_loader_states(self.source, states)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last global batch that `state` (from `state_dict`, any dp degree) counted;
        call it before iterating (an iterator already started keeps its place)."""
        mine = self._identity()
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            shown = ", ".join(f"{k}: saved {s!r}, configured {c!r}" for k, (s, c) in differ.items())
            raise ValueError(
                f"the saved data loader state does not match this job ({shown}): its position counts other "
                f"batches; to resume exactly set {self._resume_settings(differ)}, or start the data afresh with "
                f"checkpoint.exclude_from_loading=['dataloader']"
            )
        self.position, self.cursor = int(state["position"]), self.source.check_cursor(state.get("cursor"))


def merge_loader_states(source: RowSource, states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from every rank's `local_state_dict()`: they agree on all but the cursor, whose parts merge."""
    first = {k: v for k, v in states[0].items() if k != "cursor"}
    for state in states[1:]:
        rest = {k: v for k, v in state.items() if k != "cursor"}
        if rest != first:
            raise ValueError(f"data loader ranks are at different places: {first} vs {rest}")
    return {**first, "cursor": source.merge_cursors([s["cursor"] for s in states])}
