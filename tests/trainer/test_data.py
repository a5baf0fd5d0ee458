"""Data: the embedded corpus (shapes, shift, determinism, dp-disjoint and tp-identical streams), streamed local
files (packing, document kinds, epochs, errors), hub names offline, the same global batch on every dp degree and
accumulation split, the loader state resumed on another dp degree (and the keys named when it cannot be), data that
fills no batch (all blank, empty files, one tiny document), and one ./run_train.sh on a tokenizer.json and JSON
lines."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.trainer.test_tokenizer import write_tiny_tokenizer
from trainer.data import (
    DocumentStream,
    TokenBatches,
    build_data_loader,
    check_hub_reachable,
    load_tokens,
    local_documents,
)
from trainer.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _batches(dp_rank: int, dp_size: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = build_data_loader(
        "embedded", ByteTokenizer(), local_batch_size=2, seq_len=64, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )
    return list(itertools.islice(iter(loader), n))


def test_corpus_is_embedded_and_sized() -> None:
    tokens = load_tokens(ByteTokenizer())
    assert 100_000 <= tokens.numel() <= 400_000
    assert int(tokens.max()) < ByteTokenizer.vocab_size


def test_batches_are_shifted_and_shaped() -> None:
    for inputs, labels in _batches(0, 1, 3):
        assert inputs.shape == labels.shape == (2, 64) and inputs.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_batches_deterministic_by_seed() -> None:
    a, b, c = _batches(0, 2, 4, seed=1), _batches(0, 2, 4, seed=1), _batches(0, 2, 4, seed=2)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_dp_ranks_read_disjoint_windows() -> None:
    # a stream of distinct tokens, so every window is distinguishable by its content
    tokens, dp_size = torch.arange(20_000), 4
    seen: list[set[int]] = []
    for rank in range(dp_size):
        loader = TokenBatches(tokens, local_batch_size=2, seq_len=63, dp_rank=rank, dp_size=dp_size, seed=0)
        n = loader.source.batches_per_epoch  # a whole epoch: disjointness holds within an epoch
        starts = {int(row[0]) for inputs, _ in itertools.islice(iter(loader), n) for row in inputs}
        assert len(starts) == 2 * n
        seen.append(starts)
    for i, j in itertools.combinations(range(dp_size), 2):
        assert not seen[i] & seen[j], f"dp ranks {i} and {j} read the same window"
    assert sum(len(s) for s in seen) >= 20_000 // 64 - dp_size * 2  # together they cover (almost) the corpus


def test_tp_peers_of_one_dp_rank_see_the_same_batches() -> None:
    # TP ranks of one dp group have the same dp coordinates, so they build identical loaders
    peer0, peer1 = _batches(1, 2, 5), _batches(1, 2, 5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(peer0, peer1))


def test_loader_loops_forever() -> None:
    tokens = torch.arange(1000)
    loader = TokenBatches(tokens, local_batch_size=2, seq_len=9, dp_rank=0, dp_size=1, seed=0)
    batches = list(itertools.islice(iter(loader), loader.source.batches_per_epoch * 3 + 1))
    assert len(batches) == loader.source.batches_per_epoch * 3 + 1


def test_loader_too_small_corpus_errors() -> None:
    with pytest.raises(ValueError, match="lower training.seq_len"):
        TokenBatches(torch.arange(100), local_batch_size=4, seq_len=50, dp_rank=0, dp_size=2, seed=0)


# ----------------------------------------------------------------------------------- streamed files
# 40 documents of varying length (about 2,400 byte tokens framed): ~9 global batches of 8 x 32 per epoch
DOCS = [f"document {i}: " + " ".join(["lorem ipsum dolor"] * (i % 7 + 1)) for i in range(40)]


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _framed(tokenizer: Tokenizer, docs: list[str], epochs: int = 1) -> list[int]:
    """The packed stream a loader must cut: every document framed by BOS/EOS, epoch after epoch."""
    one = [t for d in docs for t in tokenizer.encode(d, bos=True, eos=True)]
    return one * epochs


def _stream_loader(path: Path, *, tokenizer: Tokenizer | None = None, **options: object) -> TokenBatches:
    kwargs = {"local_batch_size": 2, "seq_len": 31, "dp_rank": 0, "dp_size": 1, "seed": 0, **options}
    return build_data_loader("embedded", tokenizer or ByteTokenizer(), dataset_path=str(path), **kwargs)  # type: ignore[arg-type]


def _global_batches(loaders: list[TokenBatches], n: int) -> list[torch.Tensor]:
    """`n` global batches of inputs, (G, T) each, read together by the dp ranks' `loaders` (in rank order)."""
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(n):
        parts = []
        for it, loader in zip(iters, loaders):
            parts += [next(it)[0] for _ in range(loader.accumulation_steps)]
        out.append(torch.cat(parts))
    return out


def test_jsonl_stream_packs_framed_documents_in_order_across_epochs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", DOCS)
    caplog.set_level(logging.INFO, logger="trainer.data")
    loader = _stream_loader(path)
    expected = torch.tensor(_framed(ByteTokenizer(), DOCS, epochs=3))
    n_batches = len(expected) // 3 * 3 // 2 // 64  # about 1.5 epochs of micro-batches of 2 x 32 tokens
    n_windows = 2 * n_batches
    rows = list(itertools.islice(iter(loader), n_batches))
    inputs, labels = torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])  # (n_windows, 31)
    assert inputs.shape == labels.shape == (n_windows, 31)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    windows = torch.cat([inputs, labels[:, -1:]], dim=1)  # (n_windows, 32) the seq_len+1 windows
    assert torch.equal(windows.flatten(), expected[: n_windows * 32])  # continuous across the epoch seam
    assert "epoch 0 ended after 40 documents; re-reading it from the start (epoch 1)" in caplog.text


def test_txt_paragraphs_and_parquet_rows_are_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:12]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("\n\n".join(docs[:6]) + "\n\n\n")  # extra blank lines: no empty docs
    (tmp_path / "txt" / "b.txt").write_text("\n\n\n".join(docs[6:]))
    pq.write_table(pa.table({"content": docs, "n": list(range(12))}), tmp_path / "rows.parquet")
    expected = torch.tensor(_framed(ByteTokenizer(), docs))
    for loader in (_stream_loader(tmp_path / "txt"), _stream_loader(tmp_path / "rows.parquet", text_field="content")):
        windows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(iter(loader), 4)])
        assert torch.equal(windows.flatten(), expected[: 8 * 32])


def test_dataset_path_folder_is_read_recursively_in_path_order(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "data" / "b.jsonl", DOCS[20:])
    _write_jsonl(tmp_path / "data" / "a" / "part0.jsonl", DOCS[:20])
    _write_jsonl(tmp_path / "data" / ".cache" / "junk.jsonl", ["never read"])
    expected = torch.tensor(_framed(ByteTokenizer(), DOCS))
    for path in (tmp_path / "data", tmp_path / "data" / "**" / "*.jsonl"):
        windows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(iter(_stream_loader(path)), 30)])
        assert torch.equal(windows.flatten(), expected[: 60 * 32]), path


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "nope", r"training.dataset_path='.*nope' does not exist"),
        (lambda p: (p / "x.csv").write_text("a,b\n") and p, r"holds no data files; expected .txt, .json, .jsonl"),
        (lambda p: (p / "a.txt").write_text("x") and _write_jsonl(p / "b.jsonl", ["y"]) and p, r"mixes file kinds"),
        (lambda p: _write_jsonl(p / "d.jsonl", DOCS, field="content"),
         r"documents have no field 'text' \(training.dataset_text_field\); their fields are \['content', 'id'\]"),
    ],
    ids=["missing", "no_data_files", "mixed_kinds", "missing_field"],
)  # fmt: skip
def test_bad_dataset_path_names_the_key(tmp_path: Path, setup: Callable[[Path], Path], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next(iter(_stream_loader(setup(tmp_path))))


def test_stream_gives_every_dp_and_accumulation_split_the_same_global_batch(tmp_path: Path) -> None:
    stream = _jsonl(tmp_path)

    def loaders(dp: int, local: int) -> list[TokenBatches]:
        return [
            TokenBatches(stream, local_batch_size=local, seq_len=31, dp_rank=r, dp_size=dp, seed=0, global_batch_size=8)
            for r in range(dp)
        ]

    whole = _global_batches(loaders(1, 8), 16)  # past the end of the first epoch (~13)
    for dp, local in ((1, 2), (2, 2), (4, 1), (2, 4), (8, 1)):
        got = _global_batches(loaders(dp, local), 16)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), (dp, local)


def _embedded(tmp_path: Path) -> torch.Tensor | DocumentStream:
    return load_tokens(ByteTokenizer())


def _jsonl(tmp_path: Path) -> torch.Tensor | DocumentStream:
    return DocumentStream(local_documents(str(_write_jsonl(tmp_path / "d.jsonl", DOCS)), "text"), ByteTokenizer(), "d")


@pytest.mark.parametrize("make_data", [_embedded, _jsonl], ids=["embedded", "jsonl"])
def test_loader_state_resumes_on_another_dp_degree(
    tmp_path: Path, make_data: Callable[[Path], torch.Tensor | DocumentStream]
) -> None:
    """k global batches on dp=2, the state saved (JSON), then dp=1 and dp=4 continue exactly where an
    uninterrupted loader goes on (k = 15 is past the jsonl stream's first epoch, mid-document)."""
    data, k, more = make_data(tmp_path), 15, 3

    def loaders(dp: int, local: int) -> list[TokenBatches]:
        return [
            TokenBatches(data, local_batch_size=local, seq_len=31, dp_rank=r, dp_size=dp, seed=3, global_batch_size=8)
            for r in range(dp)
        ]

    uninterrupted = _global_batches(loaders(1, 4), k + more)
    first = loaders(2, 2)
    assert all(torch.equal(a, b) for a, b in zip(_global_batches(first, k), uninterrupted))
    states = [json.loads(json.dumps(loader.state_dict())) for loader in first]
    assert states[0] == states[1] and states[0]["position"] == k
    if isinstance(data, DocumentStream):
        assert states[0]["cursor"]["epoch"] == 1 and states[0]["cursor"]["token_offset"] > 0, states[0]
    for dp, local in ((1, 8), (4, 2)):
        resumed = loaders(dp, local)
        for loader in resumed:
            loader.load_state_dict(states[0])
        got = _global_batches(resumed, more)
        assert all(torch.equal(a, b) for a, b in zip(got, uninterrupted[k:])), dp


def test_loader_state_of_another_seq_len_or_batch_is_refused() -> None:
    tokens = torch.arange(5000)
    state = TokenBatches(tokens, local_batch_size=2, seq_len=31, dp_rank=0, dp_size=1, seed=0).state_dict()
    other = TokenBatches(tokens, local_batch_size=4, seq_len=15, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match=r"global_batch_size: saved 2, configured 4, seq_len: saved 31, configured 15"):
        other.load_state_dict(state)


def test_hf_tokenizer_stream_frames_its_documents(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(str(write_tiny_tokenizer(tmp_path / "tok")))
    loader = _stream_loader(_write_jsonl(tmp_path / "d.jsonl", DOCS), tokenizer=tokenizer)
    windows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(iter(loader), 5)])
    assert torch.equal(windows.flatten(), torch.tensor(_framed(tokenizer, DOCS))[: 10 * 32])
    assert windows[0, 0] == tokenizer.bos_id and int(windows.max()) < tokenizer.vocab_size


# ------------------------------------------------------------------------------------- hub names
def test_hub_dataset_offline_fails_fast_naming_the_keys(tmp_path: Path) -> None:
    # a fresh process: datasets reads HF_HUB_OFFLINE when imported
    code = (
        "from trainer.data import build_data_loader\n"
        "from trainer.tokenizer import ByteTokenizer\n"
        "build_data_loader('no-such-user/no-such-dataset', ByteTokenizer(), local_batch_size=1, seq_len=8,"
        " dp_rank=0, dp_size=1, seed=0)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("ValueError: training.dataset='no-such-user/no-such-dataset'")
    assert "training.dataset_path" in last, last
    assert time.monotonic() - start < 30  # imports only: no network retries


def test_unreachable_hub_fails_in_seconds() -> None:
    with socket.socket() as closed:  # bound, never listening: connecting is refused at once
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"training.dataset='org/name': the Hugging Face hub .* is unreachable"):
            check_hub_reachable("org/name", endpoint)
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------------------- e2e
@pytest.mark.e2e
def test_run_train_on_a_tokenizer_json_and_jsonl_folder(tmp_path: Path) -> None:
    """./run_train.sh on 2 ranks with a BPE tokenizer.json, a JSON-lines folder and model.vocab_size 2048, called
    from another folder with every path relative to it: the config file, the tokenizer, the data and the dump
    folder are the caller's (before, run_train.sh changed into the repository, where none of them existed)."""
    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer", config={"bos_token": "<|begin_of_text|>",
                                                                     "eos_token": "<|end_of_text|>"})  # fmt: skip
    _write_jsonl(tmp_path / "c4_test" / "data.json", DOCS * 5)
    (tmp_path / "job.toml").write_text((REPO / "configs" / "debug_model.toml").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_RANK", "CONFIG_FILE")}
    env.update(NGPU=str(torch.cuda.device_count() or 2), CONFIG_FILE="job.toml")
    args = [
        "--model.tokenizer_path", tokenizer.parent.name, "--training.dataset_path", "c4_test",
        "--model.vocab_size", "2048", "--training.steps", "3", "--training.seq_len", "64",
        "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", "out",
    ]  # fmt: skip
    run = subprocess.run([str(REPO / "run_train.sh"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert (tmp_path / "out" / "config.toml").is_file(), (run.stdout + run.stderr)[-3000:]
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    step_lines = [line for line in output.splitlines() if "INFO trainer.metrics: step " in line]  # not the summary
    losses = [float(line.split("| loss ")[1].split()[0]) for line in step_lines]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), output[-3000:]
    # an untrained model spreads over the padded 2048 ids (ln 2048 = 7.6; over the tokenizer's 300 it would be ~6)
    assert losses[0] > math.log(1024), losses
    assert losses[-1] < losses[0]


def test_a_data_folder_under_a_hidden_directory_is_read_and_hidden_entries_inside_are_skipped(tmp_path: Path) -> None:
    from trainer.data import resolve_data_files

    folder = tmp_path / ".cache" / "c4_test"
    _write_jsonl(folder / "data.json", DOCS)
    _write_jsonl(folder / ".partial" / "junk.json", DOCS)
    builder, files = resolve_data_files(str(folder))
    assert builder == "json" and files == [folder / "data.json"]


# -------------------------------------------------------------------------- data that fills no batch
def _bounded(source: Callable[[int], object], reads: int = 50) -> Callable[[int], object]:
    """`source`, failing the test once it is read more than `reads` times (a loader that would spin forever)."""
    calls = itertools.count(1)

    def read(skip: int) -> object:
        assert next(calls) <= reads, f"the documents were re-read {reads} times without an error"
        return source(skip)

    return read


def test_all_blank_documents_fail_at_the_first_fetch_naming_the_path(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "blank.jsonl", ["   ", " ", "  \t "])
    stream = DocumentStream(_bounded(local_documents(str(path), "text")), ByteTokenizer(), name=str(path))  # type: ignore[arg-type]
    loader = TokenBatches(stream, local_batch_size=2, seq_len=31, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match=rf"dataset '{path}' yields no training sequences: all 3 documents are blank"):
        next(iter(loader))


def test_an_empty_file_names_the_key_and_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.config.data_files import resolve_data_files

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    message = rf"training.dataset_path='{empty}': {empty} is empty \(0 bytes\)"
    with pytest.raises(ValueError, match=message):
        resolve_data_files(str(empty))
    with pytest.raises(ValueError, match=message):
        _stream_loader(empty)
    with pytest.raises(ValueError, match=rf"validation.dataset_path='{tmp_path}': all 2 files .* are empty"):
        (tmp_path / "other.jsonl").write_bytes(b"")
        resolve_data_files(str(tmp_path), "validation.dataset_path")
    _write_jsonl(tmp_path / "docs.jsonl", DOCS)  # beside data, an empty file is left out
    assert resolve_data_files(str(tmp_path))[1] == [tmp_path / "docs.jsonl"]

    import datasets

    def no_rows(*args: object, **kwargs: object) -> None:
        raise StopIteration  # what the JSON builder raises on files without rows

    monkeypatch.setattr(datasets, "load_dataset", no_rows)
    with pytest.raises(ValueError, match=r"training.dataset_path=.*hold no JSON rows to read"):
        local_documents(str(tmp_path), "text")


def test_a_tiny_dataset_logs_epochs_at_a_bounded_rate_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One short document and a global batch of 8 x 32 tokens: ~20 epochs per batch."""
    path = _write_jsonl(tmp_path / "one.jsonl", ["a short document"])
    caplog.set_level(logging.INFO, logger="trainer.data")
    loader = _stream_loader(path, global_batch_size=8, local_batch_size=8)
    list(itertools.islice(iter(loader), 2))
    epochs = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    assert 2 <= len(epochs) <= 7, epochs  # ~28 epochs read: reported after 1, 2, 4, 8, 16
    assert epochs[1].startswith(f"dataset {path}: epoch 1 ended after 1 documents") and "after epoch 3" in epochs[1]
    small = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(small) == 1 and "smaller than one global batch: an epoch is 18 tokens (1 documents)" in small[0], small


def test_resuming_with_another_dp_degree_names_the_global_batch_key() -> None:
    tokens = torch.arange(5000)
    saved = TokenBatches(tokens, local_batch_size=2, seq_len=31, dp_rank=0, dp_size=2, seed=0).state_dict()
    for dp, local, fix in ((1, 2, r"set training.global_batch_size=4, or start the data afresh"),
                           (4, 2, r"training.global_batch_size=4 and training.local_batch_size=1 \(it must divide 4 "
                                  r"/ data-parallel degree 4\)")):  # fmt: skip
        resumed = TokenBatches(tokens, local_batch_size=local, seq_len=31, dp_rank=0, dp_size=dp, seed=0)
        with pytest.raises(ValueError, match=rf"global_batch_size: saved 4, configured {local * dp}.* {fix}"):
            resumed.load_state_dict(saved)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", b'{"text": "fine"}\n{"text": "broken\n{"text": "fine"}\n',
         r"bad.jsonl, line 2, is not a JSON value \(Unterminated string"),
        ("bad.txt", b"hello world\n\ncaf\xe9 in latin-1\n", r"bad.txt, line 3, is not UTF-8 text"),
    ],
)  # fmt: skip
def test_an_unreadable_data_file_is_named_with_its_line_and_the_key(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    """Before: pyarrow's `ArrowInvalid ... in row 20` or a bare UnicodeDecodeError, naming neither file nor key."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"training.dataset_path='.*{name}': .*{message}.*Fix or remove it"):
        read = local_documents(str(path), "text")
        list(read(0))
