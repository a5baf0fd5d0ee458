"""One document stream packed in order into seq_len+1 windows (`StreamedWindows`): documents framed by
BOS/EOS, concatenated, cut every seq_len+1 tokens, epoch after epoch, packing running on across the seam.
Validation reads held-out files this way (a window at a time); training reads streams through `lanes.py`,
which packs each of its lanes the same way. `note_long_document` is the packer's one report of a document
cut over several windows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .documents import DocumentStream, ReadCount
from .source import Cursor

logger = logging.getLogger(__name__)


def note_long_document(reported: set[str], name: str, document: int, length: int, width: int) -> None:
    """Log once per dataset `name` that a document of `length` framed tokens is longer than a window of
    `width` = seq_len + 1: the packer cuts it into consecutive windows (nothing dropped), so the windows
    after its first start inside it, without a BOS."""
    if length > width and name not in reported:
        reported.add(name)
        logger.info(
            "dataset %s: document %d is %d tokens framed, longer than a window of seq_len+1 = %d: it is cut across "
            "consecutive windows of one row, in order, nothing dropped; those after its first start mid-document "
            "(no BOS). Said once per dataset",
            name, document, length, width,
        )  # fmt: skip


class StreamedWindows:
    """Documents tokenized on the fly, framed by BOS/EOS, concatenated and cut into seq_len+1 windows.

    The cursor is where the next window starts: token `token_offset` of the framed document
    `document` in epoch `epoch`. Resuming skips the documents before it without tokenizing them.
    """

    def __init__(self, stream: DocumentStream, *, seq_len: int, global_batch_size: int) -> None:
        self.stream, self.seq_len, self.global_batch_size = stream, seq_len, global_batch_size
        self._warned_small = False  # the data is smaller than a global batch: said once
        self._long: set[str] = set()  # a document longer than a window was reported

    def identity(self) -> dict[str, Any]:
        return {"dataset": self.stream.name}  # stored order, unshuffled: the seed plays no part

    def start_cursor(self) -> Cursor:
        return {"epoch": 0, "document": 0, "token_offset": 0}

    def global_batches(self, position: int, cursor: Cursor) -> Iterator[tuple[torch.Tensor, Cursor]]:
        windows = self._windows(cursor)
        while True:
            rows, after = [], cursor
            for _ in range(self.global_batch_size):
                row, after = next(windows)
                rows.append(row)
            yield torch.tensor(rows, dtype=torch.long), after  # (G, T + 1)

    def _windows(self, cursor: Cursor) -> Iterator[tuple[list[int], Cursor]]:
        """Packed windows, each with the cursor just after it, epoch after epoch."""
        width, tokenizer = self.seq_len + 1, self.stream.tokenizer
        buffer: list[int] = []  # fewer than `width` tokens carried between documents (and epochs)
        epoch, first, skip = cursor["epoch"], cursor["document"], cursor["token_offset"]  # skip: the first only
        while True:
            read = _EpochCount()
            for index, text in self.stream.non_blank(first, read):
                ids = tokenizer.encode(text, bos=True, eos=True)
                read.tokens += len(ids)
                note_long_document(self._long, self.stream.name, index, len(ids), width)
                buffer.extend(ids[skip:] if skip else ids)
                skip, start = 0, 0
                while len(buffer) - start >= width:
                    start += width
                    left = len(buffer) - start  # all of this document's: the window took the carried ones
                    yield buffer[start - width : start], _cursor_after(epoch, index, len(ids) - left, len(ids))
                buffer = buffer[start:]
            self._end_epoch(epoch, first, read)
            epoch, first = epoch + 1, 0

    def _end_epoch(self, epoch: int, first: int, read: _EpochCount) -> None:
        """Refuse data that can never fill a window; log the epoch at a bounded rate (epochs 1, 2, 4,
        8, ...: a dataset smaller than a batch is re-read many times per step). A resumed epoch
        (`first` > 0) was read in part, so only whole ones are judged."""
        name, width = self.stream.name, self.seq_len + 1
        if first == 0 and read.documents == read.blank:
            reason = "it holds no documents" if not read.documents else f"all {read.documents} documents are blank"
            raise ValueError(
                f"dataset {name!r} yields no training sequences: {reason} (whitespace only counts as blank); check "
                f"the path, its filter or the text field (training.dataset_text_field)"
            )
        batch_tokens = self.global_batch_size * width
        if first == 0 and read.tokens < batch_tokens and not self._warned_small:
            self._warned_small = True
            logger.warning(
                "dataset %s is smaller than one global batch: an epoch is %d tokens (%d documents), a global batch "
                "%d sequences x %d tokens = %d, so each batch re-reads it ~%.0f times (sequences repeat within a "
                "step); add data or lower the batch size or seq_len",
                name, read.tokens, read.documents, self.global_batch_size, width, batch_tokens,
                batch_tokens / read.tokens,
            )  # fmt: skip
        ended = epoch + 1
        if ended & (ended - 1) == 0:  # a power of two
            logger.info(
                "dataset %s: epoch %d ended after %d documents; re-reading it from the start (epoch %d)%s",
                name, epoch, first + read.documents, epoch + 1, "" if ended == 1 else f"; next report after epoch "
                f"{2 * ended - 1}",
            )  # fmt: skip


@dataclass
class _EpochCount(ReadCount):
    """What one pass over the documents read, and the tokens they framed."""

    tokens: int = 0


def _cursor_after(epoch: int, index: int, used: int, length: int) -> Cursor:
    """Where the next window starts, once `used` of the `length` tokens of document `index` are in windows."""
    if used == length:
        return {"epoch": epoch, "document": index + 1, "token_offset": 0}
    return {"epoch": epoch, "document": index, "token_offset": used}
