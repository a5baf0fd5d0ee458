"""Training data: documents -> BOS/EOS-framed tokens -> packed seq_len+1 windows -> global batches -> this
rank's (input, label) micro-batches, with a loader state that resumes on any data-parallel degree.

Where the documents come from (`build_data_loader`):
- "embedded" (the default): trainer/corpus/corpus.txt, its paragraphs the documents, tokenized once in
  memory (`corpus.ShuffledWindows`). Each epoch its windows are shuffled by (seed, epoch).
- `training.dataset_path`: local .txt, .json/.jsonl (JSON lines) or .parquet files (a file, a folder
  searched recursively, or a glob), streamed with `datasets` and tokenized on the fly (`documents.py`).
  In .txt files each blank-line-separated paragraph is a document (as in the embedded corpus); JSON and
  parquet rows are documents, their text in `training.dataset_text_field`. Several comma-separated paths
  are mixed by `training.dataset_weights` (`mixing.py`).
- any other `training.dataset`: a Hugging Face hub dataset (split "train"), streamed the same way.

The determinism contract: the global batch of step k is a function of (data, seed, global batch size G,
seq_len, k) alone, so every dp degree and accumulation split reads the same sequences; dp rank r yields
rows [r * G/dp, (r + 1) * G/dp) of it as micro-batches in order (`loader.TokenBatches`). The embedded
corpus gives global batch k the windows [b * G, (b + 1) * G) of its epoch's shuffled order. A stream
cannot be shuffled globally, so it is read in its stored order, unshuffled (shuffle the files offline if
their order is correlated), dealt document by document into G lanes, row j of every batch from lane j
(`lanes.py`, which says why): each rank tokenizes only its rows' documents, and the state holds every
lane's cursor, gathered from the ranks, so it resumes on any dp degree. `lanes.py` also says what the
packer does with documents longer than a window. An exhausted stream starts its next epoch, re-read from
the start. Data without one non-blank document fails at the first fetch, since it could never fill a window.

Files: `source.py` (the interfaces), `corpus.py`, `documents.py`, `stream.py` (one stream packed in order:
validation's reader), `lanes.py`, `mixing.py`, `loader.py`.
"""

from __future__ import annotations

from typing import Any

from ..config.data_files import accumulation_steps, resolve_data_files, split_dataset_paths
from ..tokenizer import Tokenizer
from .corpus import CORPUS_PATH, ShuffledWindows, load_tokens
from .documents import (
    HUB_PROBE_TIMEOUT_S,
    DocumentSource,
    DocumentStream,
    check_hub_reachable,
    first_unreadable,
    hub_documents,
    local_documents,
)
from .lanes import LaneWindows
from .loader import GatherState, TokenBatches, merge_loader_states
from .source import Cursor, RowSource, WindowSource
from .stream import StreamedWindows, note_long_document

__all__ = [
    "CORPUS_PATH", "HUB_PROBE_TIMEOUT_S", "Cursor", "DocumentSource", "DocumentStream", "GatherState",
    "LaneWindows", "RowSource", "ShuffledWindows", "StreamedWindows", "TokenBatches", "WindowSource",
    "accumulation_steps", "build_data_loader", "check_hub_reachable", "first_unreadable", "hub_documents",
    "load_tokens", "local_documents", "merge_loader_states", "note_long_document", "resolve_data_files",
]  # fmt: skip


def build_data_loader(
    dataset: str,
    tokenizer: Tokenizer,
    *,
    dataset_path: str = "",
    text_field: str = "text",
    dataset_weights: list[float] | None = None,
    **options: Any,
) -> TokenBatches:
    """The loader of `training.dataset_path` when set (`dataset` then only names it; several comma-separated
    paths are mixed by `dataset_weights`, checked as the pre-flight does), else of the embedded corpus or the
    hub dataset `dataset`; `options` are TokenBatches' keyword arguments (batch sizes, seq_len, dp_rank /
    dp_size, seed, gather_state)."""
    if dataset_path:
        paths, weights = split_dataset_paths(dataset_path, dataset_weights or [])
        streams = [DocumentStream(local_documents(p, text_field), tokenizer, name=p) for p in paths]
        return TokenBatches(streams, weights=weights, **options)
    if dataset == "embedded":
        return TokenBatches(load_tokens(tokenizer), name=dataset, **options)
    return TokenBatches(DocumentStream(hub_documents(dataset, text_field), tokenizer, name=dataset), **options)
