"""Validation: the held-out corpus is held out, batches cover every window once on any layout, and the
eval loss is the same global mean token loss on one process, FSDP(2) and TP(2), and through the trainer."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.trainer.test_train import _SHORT_DEBUG_JOB, _train_rank
from tests.world import run_world
from trainer.data import CORPUS_PATH, DocumentStream, StreamedWindows
from trainer.tokenizer import ByteTokenizer
from trainer.validate import IGNORE_INDEX, VALIDATION_CORPUS_PATH, one_pass, validation_batches

# a tiny Llama for the layout comparisons: TP(2) divides its heads, vocabulary and sequence
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 96, "max_seq_len": 32}
N_WINDOWS = 10  # not a multiple of any global batch below: the last one is padded


def _documents(path: Path) -> list[str]:
    return [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()][1:]  # minus the header


def _sentences(docs: list[str]) -> list[str]:
    return [s for d in docs for s in re.split(r"(?<=\.)\s+", d)]


def test_held_out_corpus_shares_no_document_with_training() -> None:
    """No held-out document is a training document, and its sentences are new except the corpus's
    stock phrases (each in the training corpus 40+ times, as common phrases are in any split)."""
    train_docs, held_out = _documents(CORPUS_PATH), _documents(VALIDATION_CORPUS_PATH)
    assert len(held_out) == 40 and not set(held_out) & set(train_docs)
    counts = Counter(_sentences(train_docs))
    stock = {s for s, n in counts.items() if n >= 10}
    assert len(stock) == 10
    shared = [s for s in _sentences(held_out) if s in counts and s not in stock]
    assert shared == []


def test_validation_batches_pad_the_last_batch_and_cover_each_window_once() -> None:
    windows = [torch.full((5,), i) for i in range(N_WINDOWS)]  # window i holds token i
    per_rank = [list(validation_batches(windows, local_batch_size=2, dp_rank=r, dp_size=2, steps=-1)) for r in (0, 1)]
    assert [len(b) for b in per_rank] == [3, 3]  # 10 windows in global batches of 4: 4, 4, 2 + 2 padded
    seen = [int(x[0, 0]) for batches in per_rank for x, y in batches for x in x.split(1) if (y != IGNORE_INDEX).any()]
    assert sorted(seen) == list(range(N_WINDOWS))
    inputs, labels = per_rank[1][-1]  # rank 1's part of the last batch is all padding
    assert inputs.shape == (2, 4) and (labels == IGNORE_INDEX).all()
    assert len(list(validation_batches(windows, local_batch_size=2, dp_rank=0, dp_size=2, steps=2))) == 2


def test_one_pass_reads_a_stream_once() -> None:
    """A stream's windows until its end (the window across the epoch seam is dropped), not forever."""
    docs = [f"document {i} " * (i + 3) for i in range(6)]
    tokenizer = ByteTokenizer()
    stream = DocumentStream(lambda skip: docs[skip:], tokenizer, name="six")
    total = sum(len(tokenizer.encode(d, bos=True, eos=True)) for d in docs)
    windows = list(one_pass(StreamedWindows(stream, seq_len=15, global_batch_size=1)))
    assert len(windows) == total // 16 and all(w.shape == (16,) for w in windows)


# ------------------------------------------------------------------------------- layouts agree
def _tiny_windows() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, TINY["vocab_size"], (N_WINDOWS, TINY["max_seq_len"] + 1), generator=g)  # (N, T + 1)


def _tiny_loss(tp: int, dp_shard: int, local_batch_size: int) -> tuple[float, int, bool]:
    """(eval loss, targets, parameters resharded and training mode back) of the tiny model under the layout."""
    import torch.distributed as dist

    from models.llama3 import Transformer, TransformerModelArgs
    from models.llama3.parallelize import parallelize_llama
    from parallelisms.dtensor import DTensor
    from parallelisms.parallel_dims import ParallelDims
    from trainer.validate import evaluate

    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)  # the same full weights on every rank, then sharded
    model = Transformer(TransformerModelArgs(**TINY))
    dp_mesh = None
    if world > 1:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, world_size=world)
        mesh = dims.build_mesh("cpu")
        parallelize_llama(model, dims, mesh, loss_parallel=dims.tp_enabled)
        dp_mesh = mesh["dp_cp"] if dims.dp_cp_enabled else None
    dp_rank = dist.get_rank() if dp_mesh is not None else 0
    batches = validation_batches(
        _tiny_windows(), local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_shard, steps=-1
    )
    result = evaluate(model, batches, device=torch.device("cpu"), dp_mesh=dp_mesh, use_loss_parallel=tp > 1)
    sharded = world == 1 or all(isinstance(p, DTensor) for p in model.parameters())
    return result.loss, result.targets, sharded and model.training


@pytest.mark.parametrize("tp, dp_shard", [(1, 2), (2, 1)], ids=["fsdp2", "tp2"])
def test_eval_loss_matches_one_process(tp: int, dp_shard: int) -> None:
    """The same weights give the same global mean token loss on FSDP(2) (2 sequences per rank) or TP(2)
    as on one process (4 per batch): every window counts once, padding counts nowhere."""
    loss, targets, restored = _tiny_loss(tp=1, dp_shard=1, local_batch_size=4)
    assert targets == N_WINDOWS * TINY["max_seq_len"] and restored
    for rank_loss, rank_targets, rank_restored in run_world(_tiny_loss, 2, tp, dp_shard, 2):
        assert rank_loss == pytest.approx(loss, abs=1e-5) and rank_targets == targets and rank_restored


# ------------------------------------------------------------------------------- through the trainer
def _validate_rank(argv: list[str]) -> list[str]:
    return _train_rank(argv, "trainer.validate")


def _val_losses(lines: list[str]) -> dict[int, float]:
    found = (re.match(r"validate step (\d+) \| loss ([\d.]+) \| batches 2 \|", line) for line in lines)
    return {int(m[1]): float(m[2]) for m in found if m}


def test_validation_through_the_trainer_fsdp2_and_tp2(tmp_path: Path) -> None:
    """Validation every 2 steps and at the last (3): logged on rank 0, in TensorBoard, and the same
    on FSDP(2) and TP(2) with loss parallelism. Both train on global batches of 4 and validate on the
    same 2 x 4 windows (TP's one dp rank takes all 4), so they agree up to TP's fp32 reordering."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    val = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2", "--validation.seq_len", "32"]
    argv = [*_SHORT_DEBUG_JOB, *val]
    fsdp = run_world(_validate_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "fsdp"),
                                         "--metrics.enable_tensorboard"])  # fmt: skip
    tp_args = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
               "--training.local_batch_size", "4", "--validation.local_batch_size", "4"]  # fmt: skip
    tp = run_world(_validate_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "tp"), *tp_args])
    fsdp_losses, tp_losses = _val_losses(fsdp[0]), _val_losses(tp[0])
    assert list(fsdp_losses) == [2, 3] and all(math.isfinite(v) for v in fsdp_losses.values()), fsdp[0]
    assert fsdp[1] == []  # only LOG_RANK ranks log
    assert list(tp_losses) == [2, 3] and tp_losses == pytest.approx(fsdp_losses, abs=3e-4), (fsdp_losses, tp_losses)
    events = EventAccumulator(str(tmp_path / "fsdp" / "tb"))
    events.Reload()
    scalars = events.Scalars("validation_metrics/loss")
    assert {e.step: e.value for e in scalars} == pytest.approx(fsdp_losses, abs=1e-4)


# ------------------------------------------------------------------------------- pre-flight
@pytest.mark.parametrize(
    "args, message",
    [
        (["--validation.freq", "0"], "validation.freq=0: must be >= 1"),
        (["--validation.steps", "0"], "validation.steps=0: must be -1 (the whole held-out set) or >= 1"),
        (["--validation.seq_len", "512"], "validation.seq_len(512) must be <= training.seq_len(256)"),
        (["--validation.seq_len", "33", "--parallelism.tensor_parallel_degree", "2"],
         "validation.seq_len(33) must be divisible by parallelism.tensor_parallel_degree(2)"),
        (["--validation.dataset", "allenai/c4"], "validation.dataset='allenai/c4': hub datasets are not read"),
        (["--validation.dataset_path", "/no/such/dir"], "validation.dataset_path='/no/such/dir' does not exist"),
        (["--validation.dataset_path", "{data}", "--training.dataset_path", "{data}"], "is not held out"),
    ],
)  # fmt: skip
def test_preflight_refuses_bad_validation(tmp_path: Path, args: list[str], message: str) -> None:
    from trainer.config import load_config
    from trainer.preflight import check_config

    (tmp_path / "a.txt").write_text("a document\n\nanother one\n")
    argv = ["--validation.enable", *(a.format(data=tmp_path / "a.txt") for a in args)]
    with pytest.raises(ValueError) as error:
        check_config(load_config(argv), world_size=2)
    assert message in str(error.value)


def test_a_validation_set_too_small_for_one_sequence_fails_at_start_naming_it(tmp_path: Path) -> None:
    """Before: the job trained validation.freq steps, then failed at the first validation without the file."""
    from trainer.validate import build_held_out_windows

    tiny = tmp_path / "held_out.txt"
    tiny.write_text("a few words of held-out text\n")
    with pytest.raises(ValueError, match=r"validation.dataset_path='.*held_out.txt' holds fewer than seq_len \+ 1"):
        build_held_out_windows("embedded", ByteTokenizer(), dataset_path=str(tiny), text_field="text", seq_len=256,
                               seed=0)  # fmt: skip
    source = build_held_out_windows("embedded", ByteTokenizer(), dataset_path=str(tiny), text_field="text", seq_len=8,
                                    seed=0)  # fmt: skip
    assert len(list(one_pass(source))) >= 1
