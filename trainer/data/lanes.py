"""Streamed training data read in lanes, so each data-parallel rank tokenizes only its share (`LaneWindows`).

A stream's non-blank documents are numbered p = 0, 1, 2, ... in stored order, epoch after epoch (an
exhausted stream is re-read from its start and the count runs on). Document p is dealt to lane p mod G
(G = the global batch size). Each lane frames its documents with BOS/EOS, concatenates them and cuts them
into seq_len+1 windows on its own, and row j of every global batch is lane j's next window. With several
sources (`training.dataset_weights`) every source has its own G lanes, and `mixing.row_sources` picks the
source of each row; row j then takes the next window of lane j of that source.

The determinism contract holds: global batch k is a function of (data, weights, seed, G, seq_len, k) alone,
so every dp degree and accumulation split reads the same sequences. dp rank r owns rows
[r * G/dp, (r + 1) * G/dp), so only those lanes: it still reads every document (the readers have no random
access) but tokenizes and packs only the 1/dp of them dealt to its lanes, which is where the time goes.

Why lanes, and why G of them: the split must not depend on the dp degree (else a checkpoint could only
resume on the degree that wrote it, as torchtitan's), and it must give each rank whole rows. G lanes serve
every dp degree, since dp divides G. Lanes drift apart (each takes documents at its own pace), so a rank's
one reader per source buffers the documents its slower lanes have not reached yet: the documents between its
slowest and fastest lane, which drift as a random walk (~sqrt(documents per lane) x the spread of document
lengths), plus whatever a document much longer than a window holds its lane back by. The alternatives were
worse: one reader per lane reads the stream G/dp times over, and splitting the stream by rank ties the data
to the dp degree.

The state: each lane's cursor, [p, epoch, index, used, length] per (source, lane): the document p whose
tokens the lane packs now (raw position `index` in epoch `epoch`, blank ones included), `used` of its
`length` framed tokens already in windows. A rank knows only its own lanes' cursors (it never tokenizes the
others' documents), while the checkpoint stores one loader state, the same on every rank; so the ranks'
cursors are gathered when the state is taken (`TokenBatches(gather_state=...)`, an all-gather in the
trainer) and merged into the whole, which any dp degree resumes from: each rank re-reads from the earliest
document its lanes need, skipping (reading, not tokenizing) the ones before.

Packing honesty: a window starts wherever the previous window of its lane ended, so most windows start
inside a document (the tail of one the previous window cut), as in torchtitan's packing; a window starting
a document starts with its BOS. A document longer than a window is cut into consecutive windows of its lane,
that is of one row in consecutive global batches, in order, nothing dropped (`note_long_document` logs the
first such cut once per dataset).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .documents import DocumentStream, ReadCount
from .mixing import row_sources, slice_bounds
from .source import Cursor
from .stream import note_long_document

logger = logging.getLogger(__name__)

LaneCursor = list[int]  # [p, epoch, index, used, length]
_FIELDS = 5


class _Dealer:
    """Deals one source's non-blank documents to this rank's lanes: document p goes to lane p mod G. One
    reader, started lazily at the earliest document the lanes need; documents a lane has not reached yet wait
    in its queue (the lanes drift apart), the other ranks' documents are skipped untokenized."""

    def __init__(self, stream: DocumentStream, lanes_of_rank: range, cursors: list[LaneCursor], lanes: int) -> None:
        self.stream, self.lanes = stream, lanes
        self.queues: dict[int, deque[tuple[int, int, int, str]]] = {j: deque() for j in lanes_of_rank}
        # the first document each lane needs: its current one when unfinished, else the lane's next
        self.wanted = {j: _first_needed(cursors[j], j, lanes) for j in lanes_of_rank}
        self.start = min((_feed_start(cursors[j]) for j in lanes_of_rank), default=(0, 0, 0))
        self._feed: Iterator[tuple[int, int, int, str]] | None = None
        self._reported_epochs = 0

    def next_document(self, lane: int) -> tuple[int, int, int, str]:
        """(p, epoch, index, text) of the next document of `lane`."""
        queue = self.queues[lane]
        if self._feed is None:
            self._feed = self._documents(*self.start)
        while not queue:
            doc = next(self._feed)
            j = doc[0] % self.lanes
            if j in self.queues and doc[0] >= self.wanted[j]:
                self.queues[j].append(doc)
        return queue.popleft()

    def _documents(self, p: int, epoch: int, first: int) -> Iterator[tuple[int, int, int, str]]:
        """Non-blank documents from raw position (epoch, first), numbered from p, epoch after epoch."""
        while True:
            read = ReadCount()
            for index, text in self.stream.non_blank(first, read):
                yield p, epoch, index, text
                p += 1
            self._end_epoch(epoch, first, read, p)
            epoch, first = epoch + 1, 0

    def _end_epoch(self, epoch: int, first: int, read: ReadCount, p: int) -> None:
        """Refuse data that can never fill a window; log the epoch at a bounded rate (after epochs 1, 2, 4, ...)."""
        name = self.stream.name
        if first == 0 and read.documents == read.blank:
            reason = "it holds no documents" if not read.documents else f"all {read.documents} documents are blank"
            raise ValueError(
                f"dataset {name!r} yields no training sequences: {reason} (whitespace only counts as blank); check "
                f"the path, its filter or the text field (training.dataset_text_field)"
            )
        nonblank = read.documents - read.blank
        if first == 0 and nonblank < self.lanes and self._reported_epochs == 0:
            logger.warning(
                "dataset %s has %d documents, fewer than the %d rows of a global batch (one lane each): each "
                "document is read by several rows of a step; add data or lower the global batch size",
                name, nonblank, self.lanes,
            )  # fmt: skip
        ended = epoch + 1
        if ended & (ended - 1) == 0 and ended > self._reported_epochs:  # a power of two
            self._reported_epochs = ended
            logger.info(
                "dataset %s: epoch %d ended after %d documents; re-reading it from the start (epoch %d)%s",
                name, epoch, first + read.documents, epoch + 1, "" if ended == 1 else f"; next report after epoch "
                f"{2 * ended - 1}",
            )  # fmt: skip


def _first_needed(cursor: LaneCursor, lane: int, lanes: int) -> int:
    p, _, index, used, length = cursor
    if index < 0:
        return lane  # not started: the lane's first document
    return p if used < length else p + lanes


def _feed_start(cursor: LaneCursor) -> tuple[int, int, int]:
    """(p, epoch, raw index) a reader can start at and still meet every document the lane needs."""
    p, epoch, index, used, length = cursor
    if index < 0:
        return (0, 0, 0)
    return (p, epoch, index) if used < length else (p + 1, epoch, index + 1)


class _Lane:
    """One lane's packer: the framed tokens of its current document and where its next window starts."""

    def __init__(self, cursor: LaneCursor) -> None:
        self.cursor = list(cursor)
        self.tokens: list[int] | None = None  # None: resumed mid-document, not re-tokenized yet

    def next_window(self, pull: Callable[[], tuple[int, int, int, str]], encode: Callable[[str], list[int]],
                    width: int, on_document: Callable[[int, int], None]) -> list[int]:  # fmt: skip
        window: list[int] = []
        while len(window) < width:
            p, epoch, index, used, length = self.cursor
            if used == length:  # the current document is used up (or there is none yet): the lane's next one
                p, epoch, index, text = pull()
                self.tokens = encode(text)
                self.cursor = [p, epoch, index, 0, len(self.tokens)]
                on_document(p, len(self.tokens))
                continue
            if self.tokens is None:  # resumed inside document p: read and tokenize it again
                q, _, _, text = pull()
                self.tokens = encode(text)
                if q != p or len(self.tokens) != length:
                    raise ValueError(
                        f"the saved data loader state expects document {p} of {length} tokens, but the data "
                        f"now gives document {q} of {len(self.tokens)}: the files or the tokenizer changed since "
                        f"the checkpoint; restore them, or start the data afresh with "
                        f"checkpoint.exclude_from_loading=['dataloader']"
                    )
            take = min(width - len(window), length - used)
            window += self.tokens[used : used + take]
            self.cursor[3] = used + take
        return window


class LaneWindows:
    """Streamed sources (weighted when several) read in G lanes; see the module docstring.

    Args:
        streams: the sources, in the order of training.dataset_path.
        weights: their mixing weights (any positive total); ignored for one source.
        seq_len: tokens per sequence (windows are seq_len + 1).
        global_batch_size: G, the number of lanes per source.
        seed: picks the rows' sources when there are several.
    """

    def __init__(
        self, streams: list[DocumentStream], *, weights: list[float], seq_len: int, global_batch_size: int, seed: int
    ) -> None:
        if len(weights) != len(streams):
            raise ValueError(f"{len(weights)} weights for {len(streams)} datasets")
        self.streams, self.weights, self.seq_len, self.seed = streams, list(weights), seq_len, seed
        self.global_batch_size = global_batch_size
        self.bounds = slice_bounds(self.weights)
        self._long: set[str] = set()

    def identity(self) -> dict[str, Any]:
        names = {"dataset": ",".join(s.name for s in self.streams)}
        if len(self.streams) == 1:
            return names  # stored order, one source: the seed plays no part
        return {**names, "dataset_weights": self.weights, "seed": self.seed}

    def start_cursor(self) -> Cursor:
        G = self.global_batch_size
        return {"lanes": [[[j - G, 0, -1, 0, 0] for j in range(G)] for _ in self.streams]}

    def local_cursor(self, cursor: Cursor, rows: range) -> Cursor:
        return {"lanes": [[c if j in rows else None for j, c in enumerate(lanes)] for lanes in cursor["lanes"]]}

    def merge_cursors(self, cursors: list[Cursor]) -> Cursor:
        merged: list[list[LaneCursor | None]] = [[None] * self.global_batch_size for _ in self.streams]
        for cursor in cursors:
            for s, lanes in enumerate(cursor["lanes"]):
                for j, c in enumerate(lanes):
                    if c is None:
                        continue
                    if merged[s][j] not in (None, c):  # two replicas of one dp rank must agree
                        raise ValueError(f"data loader ranks disagree on lane {j} of {self.streams[s].name!r}: "
                                         f"{merged[s][j]} vs {c}")  # fmt: skip
                    merged[s][j] = c
        missing = [j for lanes in merged for j, c in enumerate(lanes) if c is None]
        if missing:
            raise ValueError(
                f"the data loader state lacks lanes {sorted(set(missing))[:8]} of {self.global_batch_size}: each "
                f"rank holds only its own; gather every data-parallel rank's state (TokenBatches(gather_state=...))"
            )
        return {"lanes": merged}

    def check_cursor(self, cursor: Any) -> Cursor:
        lanes = cursor.get("lanes") if isinstance(cursor, dict) else None
        G, S = self.global_batch_size, len(self.streams)
        shape_ok = (
            isinstance(lanes, list) and len(lanes) == S
            and all(isinstance(ls, list) and len(ls) == G for ls in lanes)
            and all(isinstance(c, list) and len(c) == _FIELDS for ls in lanes for c in ls)
        )  # fmt: skip
        if not shape_ok:
            raise ValueError(
                f"the saved data loader cursor {str(cursor)[:120]!r} is not one of {S} source(s) x {G} lanes of "
                f"[p, epoch, index, used, length] (saved by an older meshtrain, which packed one stream?); start "
                f"the data afresh with checkpoint.exclude_from_loading=['dataloader']"
            )
        return {"lanes": [[[int(v) for v in c] for c in ls] for ls in lanes]}  # type: ignore[union-attr]

    def row_batches(self, position: int, cursor: Cursor, rows: range) -> Iterator[tuple[torch.Tensor, Cursor]]:
        G = self.global_batch_size
        dealers = [_Dealer(stream, rows, cursor["lanes"][s], G) for s, stream in enumerate(self.streams)]
        lanes = [{j: _Lane(cursor["lanes"][s][j]) for j in rows} for s in range(len(self.streams))]
        while True:
            sources = (
                row_sources(self.bounds, self.seed, position * G + rows.start, len(rows))
                if len(self.streams) > 1
                else [0] * len(rows)
            )
            out = [self._window(dealers[s], lanes[s][j], s, j) for j, s in zip(rows, sources, strict=True)]
            position += 1
            after = {
                "lanes": [
                    [list(lanes[s][j].cursor) if j in rows else None for j in range(G)] for s in range(len(lanes))
                ]
            }
            yield torch.tensor(out, dtype=torch.long), after  # (G/dp, T + 1)

    def _window(self, dealer: _Dealer, lane: _Lane, s: int, j: int) -> list[int]:
        """Lane j of source s: its next window of seq_len + 1 tokens."""
        stream, width = self.streams[s], self.seq_len + 1

        def encode(text: str) -> list[int]:
            return stream.tokenizer.encode(text, bos=True, eos=True)

        def on_document(p: int, length: int) -> None:
            note_long_document(self._long, stream.name, p, length, width)

        return lane.next_window(lambda: dealer.next_document(j), encode, width, on_document)
