"""Where a stream's documents come from: local .txt/.json/.jsonl/.parquet files or a Hugging Face hub
dataset, read with `datasets` in their stored order (`DocumentSource`), and the `DocumentStream` that
pairs them with a tokenizer. Reading only: packing into windows is `stream.py`'s and `lanes.py`'s.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config.data_files import resolve_data_files
from ..tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# seconds to wait for the hub's TCP port before telling the user it is unreachable (huggingface_hub
# itself retries for ~25 s and then reports only the last attempt)
HUB_PROBE_TIMEOUT_S = 3.0

# documents from index `skip` on, in the same order on every call (one call per epoch)
DocumentSource = Callable[[int], Iterable[str]]


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

    def non_blank(self, first: int, read: ReadCount) -> Iterator[tuple[int, str]]:
        """(raw index, text) of the non-blank documents from raw index `first` on, one epoch; every document
        read, and every blank one, counted in `read`."""
        for index, text in enumerate(self.documents(first), start=first):
            read.documents += 1
            if not text.strip():
                read.blank += 1  # an empty document would only add a BOS/EOS pair
                continue
            yield index, text


@dataclass
class ReadCount:
    """What one pass over a stream's documents read (for its end-of-epoch report)."""

    documents: int = 0
    blank: int = 0


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
