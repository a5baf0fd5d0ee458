"""Per-block torch.compile (apply_compile): the same loss and gradients as eager on one process, with
and without activation checkpointing; TP refused by name; FSDP(2) trains through the trainer.

The backend is "aot_eager" (dynamo + AOT autograd, eager kernels): it traces exactly what inductor
would, in seconds on CPU, without a C++ toolchain.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.llama3 import Transformer, TransformerModelArgs
from models.llama3.parallelize import apply_compile, compile_supported
from parallelisms.activation_checkpoint import apply_ac
from tests.trainer.test_train import _SHORT_DEBUG_JOB, _losses, _train_rank
from tests.world import run_world

TINY = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32)
BACKEND = "aot_eager"


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list]:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))  # (B*T, V) vs (B*T,)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_compiled_blocks_match_eager(ac_mode: str) -> None:
    torch.manual_seed(0)
    eager = Transformer(TINY)
    compiled = copy.deepcopy(eager)
    apply_ac(compiled, ac_mode)  # type: ignore[arg-type]
    apply_compile(compiled, BACKEND)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, TINY.vocab_size, (2, 2, TINY.max_seq_len), generator=g)  # 2 x (B, T)
    want_loss, want_grads = _loss_and_grads(eager, tokens, labels)
    got_loss, got_grads = _loss_and_grads(compiled, tokens, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    names = [n for n, _ in compiled.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]  # compile keeps FQNs (checkpoints, plans)
    with torch.no_grad():  # eval forward (another grad mode: recompiled, same values)
        torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-6, atol=1e-6)


def test_compile_with_tensor_parallelism_is_a_preflight_warning_and_eager_blocks() -> None:
    """torchtitan's 405B config compiles under TP 8: it must pass the pre-flight (warned), blocks stay eager."""
    from trainer.config import load_config
    from trainer.preflight import check_config

    cfg = load_config(["--compile.enable", "--parallelism.tensor_parallel_degree", "2"])
    warnings = check_config(cfg, world_size=2)
    assert any("compile.enable=true with parallelism.tensor_parallel_degree(2)" in w for w in warnings), warnings
    from parallelisms.parallel_dims import ParallelDims

    def dims(tp: int = 1, cp: int = 1) -> ParallelDims:
        return ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, world_size=tp * cp)

    assert compile_supported(dims()) and not compile_supported(dims(tp=2)) and not compile_supported(dims(cp=2))


def test_fsdp2_trains_compiled_like_eager(tmp_path: Path) -> None:
    """The trainer on 2 FSDP ranks with compiled blocks: the fully_shard hooks stay outside the compiled
    forward (all-gather, reshard, reduce-scatter as eager), and the losses are eager's."""
    compiled = _losses(run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path / "c"),
                                                  "--compile.enable", "--compile.backend", BACKEND])[0])  # fmt: skip
    eager = _losses(run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path / "e")])[0])
    assert len(compiled) == 3 and all(math.isfinite(x) for x in compiled) and compiled[-1] < compiled[0]
    assert compiled == pytest.approx(eager, abs=1e-4), (compiled, eager)  # the line shows 4 decimals


def test_preflight_warns_of_compile_with_tp(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_train.sh's pre-flight (trainer.preflight.main) passes and says the blocks stay eager."""
    from trainer.preflight import main

    monkeypatch.setenv("NGPU", "2")

    assert main(["--compile.enable", "--parallelism.tensor_parallel_degree", "2"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "config warning: compile.enable=true with parallelism.tensor_parallel_degree(2)" in last, last
