"""The interfaces between the window sources and the loader: `WindowSource` (whole global batches, as
validation reads them) and `RowSource` (only this rank's rows of each global batch, as training reads them),
and their `Cursor`, the JSON-able state a source resumes from besides the global position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

# the state a window source resumes from (JSON-able), besides the global position
Cursor = dict[str, Any]


class WindowSource(Protocol):
    """Global batches of seq_len+1 windows, addressable by their global position."""

    global_batch_size: int

    def identity(self) -> dict[str, Any]:
        """What the global batch at a position depends on, besides the position (checked on resume)."""
        ...

    def start_cursor(self) -> Cursor: ...

    def global_batches(self, position: int, cursor: Cursor) -> Iterator[tuple[torch.Tensor, Cursor]]:
        """(G, seq_len + 1) windows of global batches `position`, `position + 1`, ..., each with the
        cursor to resume after it; `cursor` is the one saved with `position`."""
        ...


class RowSource(Protocol):
    """Rows [rows.start, rows.stop) of each global batch (a data-parallel rank's share), produced without
    producing the other rows where the source can. A rank's cursor covers only its rows (the others are
    None); the ranks' cursors merge into the whole one, which any dp degree resumes from."""

    global_batch_size: int

    def identity(self) -> dict[str, Any]: ...

    def start_cursor(self) -> Cursor: ...

    def row_batches(self, position: int, cursor: Cursor, rows: range) -> Iterator[tuple[torch.Tensor, Cursor]]:
        """(len(rows), seq_len + 1) windows of global batches `position`, `position + 1`, ..., each with this
        rank's cursor after it; `cursor` is a whole one (merged, or the start)."""
        ...

    def local_cursor(self, cursor: Cursor, rows: range) -> Cursor:
        """The part of a whole `cursor` that `rows` own (what this rank reports before it has read)."""
        ...

    def merge_cursors(self, cursors: list[Cursor]) -> Cursor:
        """The whole cursor from every rank's (in any order, replicas included); refuses gaps and conflicts."""
        ...

    def check_cursor(self, cursor: Any) -> Cursor:
        """`cursor` as saved, checked to be this source's kind (ValueError naming what is wrong)."""
        ...
