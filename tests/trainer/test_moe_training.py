"""Qwen3-MoE and DeepSeek-V3 through the trainer under every parallelism: FSDP, HSDP, TP/SP (experts sharded on
their hidden dim, router replicated), PP (DeepSeek's dense block first), CP, DDP, selective activation
checkpointing, compiled blocks (TP, EP), and expert parallelism alone and with each of FSDP, TP (etp 1 and
etp = tp), PP, CP, HSDP and DDP, each
follow one process on the same global batches (fp32, AdamW, load balancing on, so the routing bias moves every
step and every layout must move it alike); the expert-load metrics are logged. A checkpoint saved under EP resumes
under TP, PP and EP x TP (routing biases, experts and their optimizer state resharded), and its export loads in
transformers with our logits. Tiny flavors of both families (registered in each rank) keep the runs to seconds;
`./run_train.sh` trains the real debug flavors (tests/trainer/test_torchtitan_configs.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.test_pipeline_training import JOB
from tests.trainer.test_train import _losses, _train_rank
from tests.world import run_world

TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
DDP2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
LBS2, LBS1 = ["--training.local_batch_size", "2"], ["--training.local_batch_size", "1"]  # dp 2, dp 4: the same batch
SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
EP2, EP4 = ["--parallelism.expert_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "4"]
ASYNC_TP = ["--parallelism.enable_async_tensor_parallel"]  # TP's collectives as collective matmuls
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]  # whole blocks; under EP around eager experts
EP_LAYOUTS = {  # name: (world, flags)
    "ep2": (2, [*EP2, *LBS2]),  # EP(2) is FSDP(2)'s ranks: the experts' FSDP group is one rank
    "fsdp4_ep2": (4, [*EP2, *LBS1]),  # the experts FSDP(2)-sharded outside ep, their gradients / 4
    "ep4": (4, [*EP4, *LBS1]),
    "ep2_tp2": (4, [*EP2, "--parallelism.tensor_parallel_degree", "2", *LBS2]),  # etp 1: ep is tp, tokens split
    "ep2_tp2_etp2": (4, [*EP2, "--parallelism.tensor_parallel_degree", "2",
                         "--parallelism.expert_tensor_parallel_degree", "2", *LBS2]),  # experts over (ep, tp)
    "ep2_pp2": (4, [*EP2, "--parallelism.pipeline_parallel_degree", "2", *LBS2]),
    "ep2_cp2": (4, [*EP2, "--parallelism.context_parallel_degree", "2", *LBS2]),  # ep is cp
    "hsdp_ep2": (4, [*EP2, *HSDP, *LBS1]),
    "ddp2_tp2_ep2": (4, [*EP2, *DDP2, "--parallelism.tensor_parallel_degree", "2", *LBS2]),  # DDP's replicas of ep
}  # fmt: skip


def register_tiny_flavors() -> None:
    """`tiny_moe` flavors of both families (this process only): every MoE feature on, seconds per step."""
    from models.common.moe_args import MoEArgs
    from models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_configs
    from models.qwen3.args import Qwen3ModelArgs, qwen3_configs

    qwen3_configs["tiny_moe"] = Qwen3ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=2048, hidden_dim=128, moe_enabled=True,
        moe_inter_dim=32, moe_args=MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax",
                                           route_norm=True, score_before_experts=False, load_balance_coeff=1e-2),
    )  # fmt: skip
    deepseek_v3_configs["tiny_moe"] = DeepSeekV3ModelArgs(
        vocab_size=2048, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=4, n_dense_layers=1, n_heads=4,
        norm_eps=1e-6,  # Hugging Face's DeepseekV3 norms its latents at 1e-6 whatever rms_norm_eps says
        q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_expert_groups=4, n_limited_groups=2,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                         route_scale=2.5, score_before_experts=False, load_balance_coeff=1e-2),
    )  # fmt: skip


def _train_tiny(argv: list[str]) -> list[str]:
    register_tiny_flavors()
    return _train_rank(argv)


def _job(family: str, folder: Path) -> list[str]:
    return [*JOB, "--model.name", family, "--model.flavor", "tiny_moe", "--job.dump_folder", str(folder)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return {
        family: run_world(_train_tiny, 1, _job(family, tmp_path_factory.mktemp(family)))[0]
        for family in ("qwen3", "deepseek_v3")
    }


@pytest.mark.parametrize(
    "family, world, layout",
    [
        ("qwen3", 2, LBS2),  # FSDP(2)
        ("qwen3", 2, [*TP2, *ASYNC_TP]),
        ("qwen3", 4, [*HSDP, *LBS1]),
        ("qwen3", 2, PP2),
        ("qwen3", 2, [*CP2, *SAC]),
        ("deepseek_v3", 4, ["--parallelism.tensor_parallel_degree", "2", *LBS2]),  # FSDP(2) x TP(2)
        ("deepseek_v3", 2, PP2),
        ("deepseek_v3", 2, CP2),
        ("deepseek_v3", 2, [*DDP2, *LBS2]),
        ("qwen3", 2, [*EP2, *LBS2, *COMPILED]),
        ("deepseek_v3", 2, [*TP2, *ASYNC_TP, *COMPILED]),
        # expert parallelism, borrowing dp_shard, tp or cp ranks (parallelisms/parallel_dims.py), on both families
        *[(family, world, layout) for family in ("qwen3", "deepseek_v3") for world, layout in EP_LAYOUTS.values()],
    ],
    ids=["qwen3_fsdp2", "qwen3_async_tp2", "qwen3_hsdp", "qwen3_pp2", "qwen3_cp2_sac", "dsv3_fsdp2_tp2", "dsv3_pp2",
         "dsv3_cp2", "dsv3_ddp2", "qwen3_ep2_compiled", "dsv3_async_tp2_compiled",
         *[f"{family}_{name}" for family in ("qwen3", "dsv3") for name in EP_LAYOUTS]],
)  # fmt: skip
def test_moe_training_follows_one_process(
    tmp_path: Path, one_process: dict[str, list[str]], family: str, world: int, layout: list[str]
) -> None:
    lines = run_world(_train_tiny, world, [*_job(family, tmp_path), *layout])[0]
    losses, reference = _losses(lines), _losses(one_process[family])
    assert len(losses) == 4 and losses == pytest.approx(reference, abs=2e-4), (reference, losses)


def test_the_expert_load_is_logged_every_log_step(one_process: dict[str, list[str]]) -> None:
    for family, n_moe in (("qwen3", 4), ("deepseek_v3", 3)):
        loads = [line for line in one_process[family] if line.startswith("moe | step")]
        assert len(loads) == 4, one_process[family]
        assert f"mean over {n_moe} layers" in loads[-1] and "routing bias max |b| " in loads[-1], loads[-1]


CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]


def test_an_expert_parallel_checkpoint_resumes_under_tp_pp_and_ep_tp_and_exports_to_transformers(
    tmp_path: Path,
) -> None:
    """Saved under EP(2) (experts Shard(0) over ep, the rest FSDP(2)); resumed with the experts whole on each rank
    (TP: hidden-sharded; PP: per stage) and under EP(2) borrowing TP(2) (the experts on another mesh)."""
    ep = [*_job("deepseek_v3", tmp_path / "ep"), *CKPT, *EP2, *LBS2]
    straight = _losses(run_world(_train_tiny, 2, ep)[0])
    for name, layout in (("tp", TP2), ("pp", PP2), ("ep_tp", [*EP2, *TP2])):
        shutil.copytree(tmp_path / "ep" / "checkpoint" / "step-2", tmp_path / name / "checkpoint" / "step-2")
        resumed = _losses(run_world(_train_tiny, 2, [*_job("deepseek_v3", tmp_path / name), *CKPT, *layout])[0])
        assert resumed == pytest.approx(straight[2:], abs=2e-4), (name, straight, resumed)
    ours, theirs = run_world(_exported_logits, 1, tmp_path / "ep" / "checkpoint" / "step-4", tmp_path / "hf")[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def _exported_logits(ckpt: Path, hf_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Our model loaded from `ckpt` and transformers' from its `to-hf` export, on the same tokens."""
    import transformers

    import checkpoint
    from checkpoint import convert
    from checkpoint.stateful import ModelState
    from models.deepseek_v3 import DeepSeekV3Model
    from models.deepseek_v3.hf_adapter import DEEPSEEK_V3_HF_ADAPTER

    register_tiny_flavors()
    assert convert.main(["to-hf", str(ckpt), str(hf_dir)]) == 0
    args = DEEPSEEK_V3_HF_ADAPTER.model_args_from_json(checkpoint.read_index(ckpt).metadata["model_args"])
    ours = DeepSeekV3Model(args)
    checkpoint.load({"model": ModelState(ours).state_dict()}, ckpt)
    assert ours.layers["1"].moe.expert_bias.abs().sum() > 0  # trained: the routing bias moved and is exported
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ours(tokens), theirs(tokens).logits


def test_float8_on_the_dense_linears_trains_fsdp_like_one_process(tmp_path: Path) -> None:
    """float8 converts the attention's and the shared experts' linears (the grouped experts and, by filter, the
    router and the output stay high precision). An activation's scale is its microbatch's, so one process
    accumulates the two-sequence microbatches FSDP(2) casts."""
    f8 = ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output,router.gate",
          "--quantize.linear.float8.emulate", *LBS2]  # fmt: skip
    one = _losses(run_world(_train_tiny, 1, [*_job("deepseek_v3", tmp_path / "one"), *f8])[0])
    fsdp = _losses(run_world(_train_tiny, 2, [*_job("deepseek_v3", tmp_path / "fsdp"), *f8])[0])
    assert len(fsdp) == 4 and fsdp == pytest.approx(one, abs=2e-4), (one, fsdp)
