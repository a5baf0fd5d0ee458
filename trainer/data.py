"""Training data: documents -> BOS/EOS-framed tokens -> packed seq_len+1 windows -> global batches -> this
rank's (input, label) micro-batches, with a loader state that resumes on any data-parallel degree.

Where the documents come from (`build_data_loader`):
- "embedded" (the default): trainer/corpus/corpus.txt, its paragraphs the documents, tokenized once in
  memory (`ShuffledWindows`). Each epoch its windows are shuffled by (seed, epoch).
- `training.dataset_path`: local .txt, .json/.jsonl (JSON lines) or .parquet files (a file, a folder
  searched recursively, or a glob), streamed with `datasets` and tokenized on the fly
  (`StreamedWindows`). In .txt files each blank-line-separated paragraph is a document (as in the
  embedded corpus); JSON and parquet rows are documents, their text in `training.dataset_text_field`.
- any other `training.dataset`: a Hugging Face hub dataset (split "train"), streamed the same way.

The determinism contract: the global batch of step k is a function of (data, seed, global batch size G,
seq_len, k) alone, so every dp degree and accumulation split reads the same sequences; dp rank r takes
rows [r * G/dp, (r + 1) * G/dp) of it and yields them as micro-batches in order (`TokenBatches`). The
embedded corpus gives global batch k the windows [b * G, (b + 1) * G) of its epoch's shuffled order.
A stream cannot be shuffled globally, and a shuffle buffer would be more state for little gain, so a
stream is read in its stored order, unshuffled (shuffle the files offline if their order is
correlated): global batch k is the stream's windows [k * G, (k + 1) * G). Every rank reads and
tokenizes the whole stream and keeps only its rows: no communication and no dependence on the dp
degree, for dp x the tokenization work. An exhausted stream starts the next epoch, re-read from the
start; packing runs on across the seam. Epoch ends are logged after epochs 1, 2, 4, 8, ... (data smaller
than a global batch is re-read many times per step, and says so once); data without one non-blank
document fails at the first fetch, since it could never fill a window.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from .config.data_files import accumulation_steps, resolve_data_files
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).parent / "corpus" / "corpus.txt"

# seconds to wait for the hub's TCP port before telling the user it is unreachable (huggingface_hub
# itself retries for ~25 s and then reports only the last attempt)
HUB_PROBE_TIMEOUT_S = 3.0

# documents from index `skip` on, in the same order on every call (one call per epoch)
DocumentSource = Callable[[int], Iterable[str]]
# the state a window source resumes from (JSON-able), besides the global position
Cursor = dict[str, int]


def load_tokens(tokenizer: Tokenizer, path: Path = CORPUS_PATH) -> torch.Tensor:
    """The whole corpus as one int64 token stream, each paragraph framed by BOS/EOS."""
    docs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, bos=True, eos=True)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class DocumentStream:
    """Documents to tokenize on the fly: `documents(skip)` iterates them from index `skip` on.

    Args:
        documents: the source, read once per epoch.
        tokenizer: frames each document with BOS/EOS.
        name: identifies the data in the loader state (the dataset name or path).
    """

    documents: DocumentSource
    tokenizer: Tokenizer
    name: str


# ------------------------------------------------------------------------------ window sources
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


class StreamedWindows:
    """Documents tokenized on the fly, framed by BOS/EOS, concatenated and cut into seq_len+1 windows.

    The cursor is where the next window starts: token `token_offset` of the framed document
    `document` in epoch `epoch`. Resuming skips the documents before it without tokenizing them.
    """

    def __init__(self, stream: DocumentStream, *, seq_len: int, global_batch_size: int) -> None:
        self.stream, self.seq_len, self.global_batch_size = stream, seq_len, global_batch_size
        self._warned_small = False  # the data is smaller than a global batch: said once

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
            for index, text in enumerate(self.stream.documents(first), start=first):
                read.documents += 1
                if not text.strip():
                    read.blank += 1  # an empty document would only add a BOS/EOS pair
                    continue
                ids = tokenizer.encode(text, bos=True, eos=True)
                read.tokens += len(ids)
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
class _EpochCount:
    """What one pass over the documents read."""

    documents: int = 0
    blank: int = 0
    tokens: int = 0


def _cursor_after(epoch: int, index: int, used: int, length: int) -> Cursor:
    """Where the next window starts, once `used` of the `length` tokens of document `index` are in windows."""
    if used == length:
        return {"epoch": epoch, "document": index + 1, "token_offset": 0}
    return {"epoch": epoch, "document": index, "token_offset": used}


# -------------------------------------------------------------------------------------- loader
class TokenBatches:
    """Infinite iterator of (input, label) int64 micro-batches, each (local_batch_size, seq_len).

    The global batch of step k is a function of (data, seed, global_batch_size, seq_len, k) alone:
    the window source's global batch at position k (G = global_batch_size windows). Data-parallel
    rank r takes its contiguous part of G / dp_size windows, and yields it as
    G / (dp_size * local_batch_size) micro-batches in order. So any dp degree and any accumulation
    split of one global batch read exactly the same sequences.

    `state_dict()` is the global position (global batches handed out in full, counted when their
    last micro-batch is) and the source's cursor, the same on every rank: it resumes on any dp
    degree or accumulation split. A state saved with another dataset, seq_len, global batch size
    or (for the shuffled corpus) seed is refused, since its position would address other data.

    Args:
        data: a token stream (the in-memory corpus, shuffled per epoch) or a `DocumentStream`.
        local_batch_size: sequences per micro-batch on this rank.
        seq_len: tokens per sequence; labels are inputs shifted left by one.
        dp_rank, dp_size: this rank's index on the data-parallel ("dp") mesh dim and its size.
        seed: shuffling seed of the in-memory corpus (same on every rank).
        global_batch_size: sequences per optimizer step over all dp ranks; None: local x dp.
        name: names the data in the state (default: "embedded" for a token stream).
    """

    def __init__(
        self,
        data: torch.Tensor | DocumentStream,
        *,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        global_batch_size: int | None = None,
        name: str = "embedded",
    ) -> None:
        global_batch = global_batch_size or local_batch_size * dp_size
        self.accumulation_steps = accumulation_steps(global_batch, local_batch_size, dp_size)
        self.source: WindowSource = (
            ShuffledWindows(data, seq_len=seq_len, global_batch_size=global_batch, seed=seed, name=name)
            if isinstance(data, torch.Tensor)
            else StreamedWindows(data, seq_len=seq_len, global_batch_size=global_batch)
        )
        self.local_batch_size, self.dp_rank, self.dp_size, self.seq_len = local_batch_size, dp_rank, dp_size, seq_len
        self.global_batch = global_batch
        self.position, self.cursor = 0, self.source.start_cursor()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        per_rank, lb = self.global_batch // self.dp_size, self.local_batch_size
        for batch, cursor in self.source.global_batches(self.position, self.cursor):
            mine = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]  # (G/dp, T + 1)
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
                "seed": "training.seed", "dataset": "training.dataset_path (or training.dataset)"}  # fmt: skip
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

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the global position, the source's cursor and what identifies the data."""
        return {**self._identity(), "position": self.position, "cursor": dict(self.cursor)}

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
        cursor = state.get("cursor", {})
        if set(cursor) != set(self.source.start_cursor()):
            raise ValueError(f"the saved data loader cursor {cursor!r} lacks keys {sorted(self.source.start_cursor())}")
        self.position, self.cursor = int(state["position"]), {k: int(v) for k, v in cursor.items()}


# ------------------------------------------------------------------------------ document sources
def _reader(
    dataset: Any, field: str, where: str, *, strip: bool, locate: Callable[[], str] = lambda: "a file"
) -> DocumentSource:
    """Documents of a streaming `datasets.IterableDataset`, their text in `field`. A file the reader cannot
    decode (pyarrow's ArrowInvalid, a UnicodeDecodeError) fails naming the key and `locate()`'s file and line."""
    features = getattr(dataset, "features", None)  # known up front for parquet and most JSON
    if features and field not in features:  # none ({}): JSON of blank lines, refused once read as empty
        raise _missing_field(field, list(features), where)

    def examples(skip: int) -> Iterator[dict[str, Any]]:
        it = iter(dataset.skip(skip) if skip else dataset)
        while True:
            try:
                yield next(it)
            except StopIteration:
                return
            except (ValueError, OSError) as e:  # the readers' own errors name neither the file nor the key
                raise ValueError(f"{where}: {locate()}; the reader said: {e}. Fix or remove it") from e

    def read(skip: int) -> Iterator[str]:
        for example in examples(skip):
            if field not in example:
                raise _missing_field(field, list(example), where)
            text = example[field]
            if not isinstance(text, str):
                raise TypeError(f"{where}: a document's {field!r} is {text!r}, not a string")
            yield text.strip() if strip else text

    return read


def _missing_field(field: str, found: list[str], where: str) -> ValueError:
    return ValueError(
        f"{where}: documents have no field {field!r} (training.dataset_text_field); "
        f"their fields are {found}; set training.dataset_text_field to the one holding the text"
    )


def local_documents(dataset_path: str, text_field: str, key: str = "training.dataset_path") -> DocumentSource:
    """Stream the files of `dataset_path` (the config key `key`) with `datasets`; .txt paragraphs are documents."""
    import datasets  # imported here: the embedded corpus needs none of it (and it takes ~2 s)

    builder, files = resolve_data_files(dataset_path, key)
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    where = f"{key}={dataset_path!r}"
    try:
        dataset = datasets.load_dataset(
            builder, data_files=[str(p) for p in files], split="train", streaming=True, **options
        )
    except (ValueError, OSError) as e:  # the JSON builder's schema probe read a malformed row
        raise ValueError(f"{where}: {first_unreadable(files, builder)}; the reader said: {e}. Fix or remove it") from e
    except StopIteration:  # the JSON builder's schema probe found no rows (it says nothing itself)
        raise ValueError(
            f"{key}={dataset_path!r}: {[str(p) for p in files[:3]]} hold no JSON rows to read; point {key} at "
            f"files holding documents"
        ) from None
    logger.info("dataset_path %s: %d %s file(s), streamed", dataset_path, len(files), builder)
    field = "text" if builder == "text" else text_field  # the text builder's one column
    return _reader(dataset, field, where, strip=builder == "text", locate=lambda: first_unreadable(files, builder))


def first_unreadable(files: list[Path], builder: str) -> str:
    """The first file and line that is not UTF-8 text (or, for JSON lines, not a JSON value), for an error message
    (read only once a reader has failed); the files themselves when none is found."""
    for path in files:
        if builder not in ("text", "json"):
            break
        raw = path.read_bytes()
        if builder == "json" and _whole_json(raw):
            continue
        for number, line in enumerate(raw.split(b"\n"), 1):
            try:
                text = line.decode("utf-8")
                if builder == "json" and text.strip():
                    json.loads(text)
            except UnicodeDecodeError as e:
                return f"{path}, line {number}, is not UTF-8 text ({e.reason} at byte {e.start} of the line)"
            except json.JSONDecodeError as e:
                return f"{path}, line {number}, is not a JSON value ({e.msg}, column {e.colno})"
    return f"one of {[str(p) for p in files[:3]]}{' ...' if len(files) > 3 else ''} cannot be read"


def _whole_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


def check_hub_reachable(name: str, endpoint: str) -> None:
    """Fail in seconds when the hub's port cannot be reached, where huggingface_hub would retry for
    ~25 s. Skipped offline (HF_HUB_OFFLINE: only the cache is read) and behind a proxy (the socket
    would not use it)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(
            f"training.dataset={name!r}: the Hugging Face hub ({host}:{port}) is unreachable ({e}); set "
            f"HF_HUB_OFFLINE=1 to read a cached copy, or training.dataset_path to local .txt/.json/.jsonl/.parquet "
            f"files, or training.dataset='embedded'"
        ) from e


def hub_documents(name: str, text_field: str) -> DocumentSource:
    """Stream split "train" of the hub dataset `name` (training.dataset), from the cache when offline."""
    import datasets
    from huggingface_hub import constants

    if not datasets.config.HF_HUB_OFFLINE:
        check_hub_reachable(name, constants.ENDPOINT)
    try:
        dataset = datasets.load_dataset(name, split="train", streaming=True)
    except (OSError, ValueError) as e:  # not found, offline (ConnectionError), a config name missing, ...
        raise ValueError(
            f"training.dataset={name!r} cannot be opened from the Hugging Face hub or its local cache "
            f"({type(e).__name__}: {e}); set training.dataset_path to local .txt/.json/.jsonl/.parquet files, "
            f"or training.dataset='embedded'"
        ) from e
    return _reader(dataset, text_field, f"training.dataset={name!r}", strip=False)


def build_data_loader(
    dataset: str, tokenizer: Tokenizer, *, dataset_path: str = "", text_field: str = "text", **options: Any
) -> TokenBatches:
    """The loader of `training.dataset_path` when set (`dataset` then only names it), else of the
    embedded corpus or the hub dataset `dataset`; `options` are TokenBatches' keyword arguments
    (batch sizes, seq_len, dp_rank / dp_size, seed)."""
    if dataset_path:
        stream = DocumentStream(local_documents(dataset_path, text_field), tokenizer, name=dataset_path)
        return TokenBatches(stream, **options)
    if dataset == "embedded":
        return TokenBatches(load_tokens(tokenizer), name=dataset, **options)
    return TokenBatches(DocumentStream(hub_documents(dataset, text_field), tokenizer, name=dataset), **options)
