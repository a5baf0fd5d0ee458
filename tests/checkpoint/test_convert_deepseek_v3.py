"""`python -m checkpoint.convert` of DeepSeek-V3: transformers' `save_pretrained` folder (the hub format, one tensor
per expert) -> from-hf -> our checkpoint (experts stacked) -> to-hf -> a folder equal to the first bit for bit; our
checkpoint's model gives transformers' logits; to-hf of a softmax-scored flavor is refused, naming why."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import checkpoint
from checkpoint import convert
from checkpoint.stateful import ModelState
from models.deepseek_v3 import DeepSeekV3Model, deepseek_v3_configs, parameter_shapes
from models.deepseek_v3 import hf_adapter as hf
from tests.models.test_deepseek_v3 import _hf_config, _yarn, random_hf_model

transformers = pytest.importorskip("transformers")

# node-limited routing, low-rank queries, two shared experts, YaRN: every tensor kind and the rope fields
CONFIG = _hf_config(q_lora_rank=12, n_group=4, topk_group=2, n_shared_experts=2, rope_scaling=_yarn())


def _run(*argv: str | Path) -> int:
    return convert.main([str(a) for a in argv])


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path, Path]:
    """(HF model, its save_pretrained folder, our from-hf checkpoint, the to-hf folder of that)."""
    root = tmp_path_factory.mktemp("dsv3")
    theirs = random_hf_model(CONFIG, seed=7)
    theirs.save_pretrained(root / "hf")
    assert _run("from-hf", root / "hf", root / "ours") == 0
    assert _run("to-hf", root / "ours", root / "hf2") == 0
    return theirs, root / "hf", root / "ours", root / "hf2"


def test_save_pretrained_writes_the_hub_format_with_one_tensor_per_expert(converted) -> None:
    """transformers 5 fuses the experts in memory (gate_up_proj) but saves them as the hub has them, per expert."""
    _, hf_dir, _, _ = converted
    names = set(_hf_tensors(hf_dir))
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert not any("gate_up_proj" in n for n in names)


def test_hf_to_ours_to_hf_is_bitwise(converted) -> None:
    _, hf_dir, _, hf2 = converted
    want, got = _hf_tensors(hf_dir), _hf_tensors(hf2)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"differ: {bad}"


def test_our_checkpoint_stacks_the_experts_and_gives_transformers_logits(converted) -> None:
    theirs, hf_dir, ours_dir, _ = converted
    meta = checkpoint.read_index(ours_dir).metadata
    args = hf.model_args_from_json(meta["model_args"])
    assert args == hf.args_from_hf_config(theirs.config.to_dict()) and args.yarn_enabled
    ours = DeepSeekV3Model(args)
    checkpoint.load({"model": ModelState(ours).state_dict()}, ours_dir)
    experts = _hf_tensors(hf_dir)
    torch.testing.assert_close(
        ours.layers["1"].moe.experts.w2[5], experts["model.layers.1.mlp.experts.5.down_proj.weight"]
    )
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # 2e-5: HF rounds YaRN's interpolated frequencies (1 / (factor base^j)) and the softmax scale differently
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=2e-5, rtol=1e-5)


def test_hf_config_of_the_export_loads_in_transformers(converted) -> None:
    _, _, _, hf2 = converted
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf2, dtype=torch.float32)
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert (theirs.config.n_group, theirs.config.topk_group, theirs.config.q_lora_rank) == (4, 2, 12)


def test_to_hf_of_a_softmax_flavor_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], n_layers=2, vocab_size=64, dim=32, inter_dim=48,
                               moe_inter_dim=16, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                               v_head_dim=8, max_seq_len=32)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    state = {k: torch.randn(shape, generator=g) for k, shape in parameter_shapes(args).items()}
    metadata = {"job_config": {"model": {"name": "deepseek_v3", "flavor": "custom"}},
                "model_args": hf.model_args_to_json(args)}  # fmt: skip
    ours = checkpoint.save({"model": state}, tmp_path / "step-1", metadata=metadata)
    assert _run("to-hf", ours, tmp_path / "hf") == 1
    assert "score_func='softmax': HF's DeepseekV3 router scores with sigmoid only" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "config.json").exists()
