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


def _lanes(tokenizer: Tokenizer, docs: list[str], lanes: int, epochs: int = 1) -> list[torch.Tensor]:
    """What each lane (row of a global batch) of a stream packs: the non-blank documents p = 0, 1, ... (epoch
    after epoch) with p mod `lanes` = the lane, each framed by BOS/EOS, concatenated."""
    seq = [d for _ in range(epochs) for d in docs if d.strip()]
    return [
        torch.tensor([t for d in seq[j::lanes] for t in tokenizer.encode(d, bos=True, eos=True)]) for j in range(lanes)
    ]


def _rows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each row's seq_len+1 windows over `batches` (one micro-batch per global batch), concatenated."""
    windows = torch.stack([torch.cat([x, y[:, -1:]], 1) for x, y in batches])  # (n, G, T + 1)
    return [windows[:, j].flatten() for j in range(windows.shape[1])]


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
    loader = _stream_loader(path)  # a global batch of 2 rows: lane 0 packs the even documents, lane 1 the odd
    expected = _lanes(ByteTokenizer(), DOCS, 2, epochs=3)
    n_batches = len(expected[0]) // 2 // 32  # about 1.5 epochs of global batches of 2 x 32 tokens
    batches = list(itertools.islice(iter(loader), n_batches))
    inputs, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])  # (2 n, 31)
    assert inputs.shape == labels.shape == (2 * n_batches, 31)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    for row, lane in zip(_rows(batches), expected, strict=True):
        assert torch.equal(row, lane[: n_batches * 32])  # continuous across the epoch seam
    assert "epoch 0 ended after 40 documents; re-reading it from the start (epoch 1)" in caplog.text


def test_txt_paragraphs_and_parquet_rows_are_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:12]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("\n\n".join(docs[:6]) + "\n\n\n")  # extra blank lines: no empty docs
    (tmp_path / "txt" / "b.txt").write_text("\n\n\n".join(docs[6:]))
    pq.write_table(pa.table({"content": docs, "n": list(range(12))}), tmp_path / "rows.parquet")
    expected = _lanes(ByteTokenizer(), docs, 2)
    for loader in (_stream_loader(tmp_path / "txt"), _stream_loader(tmp_path / "rows.parquet", text_field="content")):
        for row, lane in zip(_rows(list(itertools.islice(iter(loader), 4))), expected, strict=True):
            assert torch.equal(row, lane[: 4 * 32])


def test_dataset_path_folder_is_read_recursively_in_path_order(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "data" / "b.jsonl", DOCS[20:])
    _write_jsonl(tmp_path / "data" / "a" / "part0.jsonl", DOCS[:20])
    _write_jsonl(tmp_path / "data" / ".cache" / "junk.jsonl", ["never read"])
    expected = _lanes(ByteTokenizer(), DOCS, 2)
    for path in (tmp_path / "data", tmp_path / "data" / "**" / "*.jsonl"):
        for row, lane in zip(_rows(list(itertools.islice(iter(_stream_loader(path)), 30))), expected, strict=True):
            assert torch.equal(row, lane[: 30 * 32]), path


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


def _mixed(tmp_path: Path) -> list[DocumentStream]:
    """Two sources, equal weights: DOCS and their reversal."""
    return [
        DocumentStream(
            local_documents(str(_write_jsonl(tmp_path / f"{name}.jsonl", docs)), "text"), ByteTokenizer(), name
        )
        for name, docs in (("fwd", DOCS), ("rev", DOCS[::-1]))
    ]


@pytest.mark.parametrize("make_data", [_embedded, _jsonl, _mixed], ids=["embedded", "jsonl", "mixed"])
def test_loader_state_resumes_on_another_dp_degree(
    tmp_path: Path, make_data: Callable[[Path], torch.Tensor | DocumentStream | list[DocumentStream]]
) -> None:
    """k global batches on dp=2, the state saved (JSON), then dp=1 and dp=4 continue exactly where an
    uninterrupted loader goes on (k = 15, 30 for two mixed sources, is past the streams' first epoch, mid-document)."""
    data, more = make_data(tmp_path), 3
    k = 30 if isinstance(data, list) else 15  # two sources: each lane reads half as fast

    def loaders(dp: int, local: int) -> list[TokenBatches]:
        group: list[TokenBatches] = []  # gather_state: the all-gather of the ranks' parts, simulated
        group += [
            TokenBatches(data, local_batch_size=local, seq_len=31, dp_rank=r, dp_size=dp, seed=3, global_batch_size=8,
                         gather_state=lambda _: [loader.local_state_dict() for loader in group])
            for r in range(dp)
        ]  # fmt: skip
        return group

    uninterrupted = _global_batches(loaders(1, 4), k + more)
    first = loaders(2, 2)
    assert all(torch.equal(a, b) for a, b in zip(_global_batches(first, k), uninterrupted))
    states = [json.loads(json.dumps(loader.state_dict())) for loader in first]
    assert states[0] == states[1] and states[0]["position"] == k
    if not isinstance(data, torch.Tensor):  # each lane's [p, epoch, index, used, length]: past the seam, mid-document
        lanes = [c for source in states[0]["cursor"]["lanes"] for c in source]
        assert any(c[1] == 1 for c in lanes) and any(0 < c[3] < c[4] for c in lanes), lanes
        with pytest.raises(ValueError, match=r"lacks lanes \[4, 5, 6, 7\] of 8: each rank holds only its own"):
            TokenBatches(
                data, local_batch_size=2, seq_len=31, dp_rank=0, dp_size=2, seed=3, global_batch_size=8
            ).state_dict()
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
    batches = list(itertools.islice(iter(loader), 5))
    for row, lane in zip(_rows(batches), _lanes(tokenizer, DOCS, 2), strict=True):
        assert torch.equal(row, lane[: 5 * 32])
        assert row[0] == tokenizer.bos_id and int(row.max()) < tokenizer.vocab_size


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
    assert len(small) == 1 and "has 1 documents, fewer than the 8 rows of a global batch" in small[0], small


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


# ------------------------------------------------------------------------------ mixing, lanes, packing
def _letters(letter: str, n: int) -> list[str]:
    """`n` documents of one letter, of varying length: a row's letter tells its source."""
    return [letter * (5 + (i * 7) % 23) for i in range(n)]


def test_row_sources_give_each_source_its_weight_within_a_thousandth() -> None:
    from trainer.data.mixing import row_sources, slice_bounds

    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2], [1.0, 0.0, 3.0]):
        picks = row_sources(slice_bounds(weights), 5, first_row=10**9, count=20_000)  # far in: exact integer math
        shares = [picks.count(s) / len(picks) for s in range(len(weights))]
        assert all(abs(share - w / sum(weights)) <= 1e-3 for share, w in zip(shares, weights)), (weights, shares)
    assert row_sources(slice_bounds([1, 1]), 0, 0, 64) != row_sources(slice_bounds([1, 1]), 1, 0, 64)  # the seed acts


def test_mixed_sources_share_tokens_by_weight_within_half_a_percent(tmp_path: Path) -> None:
    """2,000 rows of 32 tokens over three sources (one of weight 0): each source's share of the tokens is its
    normalized weight within 0.005, the same at dp 1 and 2, and the weight-0 source is never read."""
    paths = [_write_jsonl(tmp_path / f"{c}.jsonl", _letters(c, 300)) for c in "abc"]
    weights = [3.0, 0.0, 1.0]

    def loaders(dp: int) -> list[TokenBatches]:
        return [
            build_data_loader(
                "embedded",
                ByteTokenizer(),
                dataset_path=",".join(map(str, paths)),
                dataset_weights=weights,
                local_batch_size=8 // dp,
                seq_len=31,
                dp_rank=r,
                dp_size=dp,
                seed=7,
            )  # fmt: skip
            for r in range(dp)
        ]

    whole = torch.cat(_global_batches(loaders(1), 250))  # (2000, 31)
    assert all(torch.equal(a, b) for a, b in zip(_global_batches(loaders(2), 20), whole.split(8)))
    content = whole.masked_fill(whole >= 256, 0).amax(dim=1)  # each row's letter (BOS/EOS masked out)
    tokens = {c: int((content == ord(c)).sum()) * 32 / (whole.shape[0] * 32) for c in "abc"}
    assert abs(tokens["a"] - 0.75) <= 0.005 and tokens["b"] == 0 and abs(tokens["c"] - 0.25) <= 0.005, tokens


def test_each_dp_rank_tokenizes_only_its_lanes_documents(tmp_path: Path) -> None:
    """dp=4, G=8: rank r tokenizes documents p with p mod 8 in {2r, 2r + 1}, a quarter of them."""
    docs = [f"doc{p:03d} " + "x" * (p % 11) for p in range(64)]
    path = _write_jsonl(tmp_path / "d.jsonl", docs)

    class Counting(ByteTokenizer):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
            self.seen.append(int(text[3:6]))
            return super().encode(text, bos=bos, eos=eos)

    for r in range(4):
        tokenizer = Counting()
        loader = build_data_loader("embedded", tokenizer, dataset_path=str(path), local_batch_size=2, seq_len=15,
                                   dp_rank=r, dp_size=4, seed=0, global_batch_size=8)  # fmt: skip
        list(itertools.islice(iter(loader), 6))
        assert tokenizer.seen and {p % 8 for p in tokenizer.seen} == {2 * r, 2 * r + 1}, (r, tokenizer.seen)
        assert len(set(tokenizer.seen)) <= len(docs) // 4 + 2, r


def test_a_document_longer_than_a_window_is_cut_across_one_rows_windows_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The packer never drops or reorders tokens: a 100-token document spans consecutive windows of one row
    (lane), the windows after its first start mid-document (no BOS), and one log line says so per dataset."""
    docs = ["L" * 100, "short one", "M" * 90, "short two"]  # lane 0: the two long documents
    path = _write_jsonl(tmp_path / "long.jsonl", docs)
    caplog.set_level(logging.INFO, logger="trainer.data")
    batches = list(itertools.islice(iter(_stream_loader(path)), 6))  # 2 rows of 32 tokens
    rows = _rows(batches)
    assert torch.equal(rows[0], _lanes(ByteTokenizer(), docs, 2, epochs=2)[0][: 6 * 32])
    windows = rows[0].view(6, 32)
    assert windows[0, 0] == ByteTokenizer.bos_id and windows[1, 0] == ord("L") and windows[2, 0] == ord("L")
    cuts = [r.getMessage() for r in caplog.records if "longer than a window" in r.getMessage()]
    assert len(cuts) == 1 and "document 0 is 102 tokens framed, longer than a window of seq_len+1 = 32" in cuts[0]


@pytest.mark.parametrize(
    ("path", "weights", "message"),
    [
        ("{a},{b}", [1.0, -0.5], r"training.dataset_weights=\[1.0, -0.5\]: the weight of '.*b.jsonl' is negative"),
        ("{a},{b}", [0.0, 0.0], r"training.dataset_weights=\[0.0, 0.0\] sum to 0: .*give at least one path"),
        ("{a},{b}", [1.0, "x"], r"training.dataset_weights=\[1.0, 'x'\]: the weight of '.*b.jsonl' is 'x', not a"),
        ("{a},{b}", [1.0], r"has 1 weight\(s\) for 2 training.dataset_path entries .*; give one weight per path"),
        ("{a},{b},", [], r"training.dataset_path='.*': entry 3 is empty"),
        ("{a},{nope}", [1.0, 1.0], r"training.dataset_path='.*nope' does not exist; point it at a file"),
        ("", [1.0], r"training.dataset_weights=\[1.0\] is set but training.dataset_path is empty"),
    ],
    ids=["negative", "zero_total", "not_a_number", "count", "empty_entry", "missing_path", "no_path"],
)
def test_bad_mixing_input_fails_in_one_line_naming_the_key(
    tmp_path: Path, path: str, weights: list[float], message: str
) -> None:
    from trainer.config.data_files import check_dataset_mix

    files = {c: str(_write_jsonl(tmp_path / f"{c}.jsonl", DOCS[:4])) for c in "ab"}
    dataset_path = path.format(a=files["a"], b=files["b"], nope=tmp_path / "nope")
    with pytest.raises((ValueError, TypeError), match=message) as error:
        check_dataset_mix(dataset_path, weights)
    assert "\n" not in str(error.value)
    if dataset_path:  # the loader refuses it the same way
        with pytest.raises((ValueError, TypeError), match=message):
            build_data_loader("embedded", ByteTokenizer(), dataset_path=dataset_path, dataset_weights=weights,
                              local_batch_size=2, seq_len=15, dp_rank=0, dp_size=1, seed=0)  # fmt: skip


def test_mixing_weights_are_checked_before_launch(tmp_path: Path) -> None:
    from trainer.config import load_config
    from trainer.preflight import check_config

    a, b = (str(_write_jsonl(tmp_path / f"{c}.jsonl", DOCS[:4])) for c in "ab")
    with pytest.raises(TypeError, match=r"training.dataset_weights='x': expected a float"):
        load_config(["--training.dataset_weights", "1,x"])
    cfg = load_config(["--job.dump_folder", str(tmp_path / "out"), "--training.dataset_path", f"{a},{b}",
                       "--training.dataset_weights", "2,-1"])  # fmt: skip
    with pytest.raises(ValueError, match=r"the weight of '.*b.jsonl' is negative \(-1.0\)"):
        check_config(cfg, world_size=1)
    cfg.training.dataset_weights = [2.0, 1.0]
    check_config(cfg, world_size=1)
    cfg.validation.enable, cfg.validation.dataset_path = True, b  # held-out data checked against every entry
    with pytest.raises(ValueError, match=r"validation.dataset_path='.*b.jsonl' shares files with training"):
        check_config(cfg, world_size=1)


def test_a_mixed_state_of_other_weights_is_refused_naming_the_key(tmp_path: Path) -> None:
    a, b = (str(_write_jsonl(tmp_path / f"{c}.jsonl", DOCS[:8])) for c in "ab")

    def loader(weights: list[float]) -> TokenBatches:
        return build_data_loader("embedded", ByteTokenizer(), dataset_path=f"{a},{b}", dataset_weights=weights,
                                 local_batch_size=2, seq_len=15, dp_rank=0, dp_size=1, seed=0)  # fmt: skip

    saved = loader([1.0, 1.0]).state_dict()
    with pytest.raises(ValueError, match=r"dataset_weights: saved \[0.5, 0.5\], configured \[0.75, 0.25\].* set "
                                         r"training.dataset_weights=\[0.5, 0.5\]"):  # fmt: skip
        loader([3.0, 1.0]).load_state_dict(saved)


def _in_memory(skip: int) -> list[str]:
    return DOCS[skip:]


def _state_after(k: int) -> dict[str, object]:
    """On a rank of a gloo world: the loader state after k global batches of DOCS (in memory: no `datasets` import
    in the ranks) at dp = world size, gathered as the trainer gathers it (an all-gather over the dp ranks)."""
    import torch.distributed as dist

    from parallelisms.dtensor.collectives import all_gather_object

    def gather(state: dict[str, object]) -> list[dict[str, object]]:
        assert dist.group.WORLD is not None
        return all_gather_object(state, dist.group.WORLD)  # type: ignore[return-value]

    dp, rank = dist.get_world_size(), dist.get_rank()
    loader = TokenBatches(DocumentStream(_in_memory, ByteTokenizer(), "docs"), local_batch_size=8 // dp, seq_len=31,
                          dp_rank=rank, dp_size=dp, seed=0, global_batch_size=8, gather_state=gather)  # fmt: skip
    list(itertools.islice(iter(loader), k))
    return loader.state_dict()


def test_the_gathered_state_is_every_ranks_and_resumes_in_one_process() -> None:
    from tests.world import run_world

    states = run_world(_state_after, 2, 12)
    assert states[0] == states[1]

    def loader() -> TokenBatches:
        stream = DocumentStream(_in_memory, ByteTokenizer(), "docs")
        return TokenBatches(stream, local_batch_size=8, seq_len=31, dp_rank=0, dp_size=1, seed=0, global_batch_size=8)

    uninterrupted, resumed = _global_batches([loader()], 15), loader()
    resumed.load_state_dict(states[0])
    assert all(torch.equal(a, b) for a, b in zip(_global_batches([resumed], 3), uninterrupted[12:], strict=True))
