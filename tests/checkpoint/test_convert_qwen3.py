"""`python -m checkpoint.convert` for Qwen3 and Qwen3-MoE: transformers' `save_pretrained` folder -> from-hf ->
to-hf is bitwise the same folder, our model built from the converted checkpoint's metadata gives transformers'
logits, the per-expert hub tensors stack into our (E, ...) expert weights and back, the MoE's routing bias (which
HF has no place for) is zero on reading and refused non-zero on writing, and configs our model cannot express
are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from checkpoint import convert, hf_conversion, hf_state
from checkpoint.stateful import ModelState
from models.common.moe_args import MoEArgs
from models.qwen3 import Qwen3Model, Qwen3ModelArgs
from models.qwen3 import hf_adapter as hf

transformers = pytest.importorskip("transformers")
from tests.models.test_qwen3 import build_hf_model  # noqa: E402  (needs transformers)

CASES = {
    "moe": dict(moe=True, top_k=2, norm_topk_prob=True),
    "moe_tied_raw_scores": dict(moe=True, top_k=3, norm_topk_prob=False, tied=True),
    "dense_tied": dict(moe=False, tied=True),
}


def _run(*argv: str | Path) -> int:
    return convert.main([str(a) for a in argv])


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, path in hf_conversion.hf_weight_files(hf_dir).items():
        with safe_open(path, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_folder_round_trips_bitwise_and_gives_transformers_logits(case: str, tmp_path: Path) -> None:
    theirs = build_hf_model(**CASES[case])  # type: ignore[arg-type]
    theirs.save_pretrained(tmp_path / "hf")
    source = _hf_tensors(tmp_path / "hf")
    if CASES[case]["moe"]:  # transformers 5 fuses the experts in memory and writes the hub's per-expert format
        assert "model.layers.1.mlp.experts.5.down_proj.weight" in source
        assert not any("gate_up_proj" in name for name in source)

    assert _run("from-hf", tmp_path / "hf", tmp_path / "ours") == 0
    assert _run("to-hf", tmp_path / "ours", tmp_path / "hf2") == 0
    back = _hf_tensors(tmp_path / "hf2")
    assert sorted(back) == sorted(source)
    assert [n for n in source if back[n].dtype != source[n].dtype or not torch.equal(back[n], source[n])] == []

    meta = checkpoint.read_index(tmp_path / "ours").metadata
    assert meta["job_config"]["model"]["name"] == "qwen3"
    ours = Qwen3Model(hf.model_args_from_json(meta["model_args"]))
    if CASES[case]["moe"]:
        assert ours.layers["0"].moe.experts.w1.shape == (6, 32, 64)  # (E, H, D): the experts stacked
    checkpoint.load({"model": ModelState(ours).state_dict()}, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf2", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        want = theirs(_tokens()).logits
        torch.testing.assert_close(ours(_tokens()), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reloaded(_tokens()).logits, want, atol=0, rtol=0)


# a job balancing its experts (torchtitan's default): its model holds the routing bias `moe.expert_bias`
BALANCED = Qwen3ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, hidden_dim=96, max_seq_len=32,
    moe_enabled=True, moe_inter_dim=32,
    moe_args=MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                     score_before_experts=False, load_balance_coeff=1e-3),
)  # fmt: skip


def _save_ours(model: Qwen3Model, directory: Path) -> Path:
    metadata = {"job_config": {"model": {"name": "qwen3", "flavor": "custom"}},
                "model_args": hf.model_args_to_json(model.model_args)}  # fmt: skip
    return checkpoint.save({"model": ModelState(model).state_dict()}, directory, metadata=metadata)


def test_routing_bias_is_refused_non_zero_and_left_out_at_zero(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = Qwen3Model(BALANCED)
    assert model.layers["1"].moe.expert_bias is not None
    model.layers["1"].moe.expert_bias[2] = 0.25  # what load balancing leaves after training
    assert _run("to-hf", _save_ours(model, tmp_path / "biased"), tmp_path / "refused") == 1
    assert "layers.1.moe.expert_bias is not zero" in capsys.readouterr().err
    model.layers["1"].moe.expert_bias.zero_()
    assert _run("to-hf", _save_ours(model, tmp_path / "zero"), tmp_path / "hf") == 0
    written = _hf_tensors(tmp_path / "hf")
    assert not any("bias" in name for name in written)
    w1 = model.layers["0"].moe.experts.w1.detach()
    assert all(torch.equal(written[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], w1[e]) for e in range(4))

    # the live load of the trainer: a balanced job's model from the HF folder, the bias at zero
    torch.manual_seed(1)
    job = Qwen3Model(BALANCED)
    job.layers["0"].moe.expert_bias.fill_(1.0)
    state = ModelState(job).state_dict()
    hf_state.load_hf_model(
        state, tmp_path / "hf", hf_conversion.hf_weight_files(tmp_path / "hf"), BALANCED, hf.QWEN3_HF_ADAPTER
    )
    for fqn, want in ModelState(model).state_dict().items():
        assert torch.equal(state[fqn], want), fqn


def _hf_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(hf_dir / "model.safetensors"))
    return hf_dir


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
            "model_type is 'mistral', which meshtrain does not convert; it converts ['deepseek_v3', 'llama'",
        ),
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]: meshtrain's Qwen3-MoE has an MoE in every layer"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "our Qwen3 implements plain RoPE only"),
    ],
)
def test_from_hf_refuses_a_model_it_cannot_convert_naming_why(change, needle, tmp_path: Path, capsys) -> None:
    config = {**hf.hf_config(BALANCED, dtype="float32"), **change}
    assert _run("from-hf", _hf_dir(tmp_path, config), tmp_path / "ours") == 1
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "ours").exists()
