"""models/qwen3: the flavors against torchtitan v0.2's, parameter counts against the published ones, argument
errors, the HF adapter's names / permutations / config.json, and our model against transformers' Qwen3 and
Qwen3-MoE (logits and gradients in fp32, weights mapped in memory through the adapter); a one-step training smoke
of the MoE debug flavor."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from models.common.moe_args import MoEArgs
from models.common.rope import apply_rotary_emb, precompute_freqs_cis
from models.hf_adapters import hf_adapter
from models.qwen3 import Qwen3Model, Qwen3ModelArgs, parameter_shapes, qwen3_configs
from models.qwen3 import hf_adapter as hf

transformers = pytest.importorskip("transformers")

# torchtitan v0.2's qwen3_args, the fields that differ between flavors:
# (dim, n_layers, n_heads, n_kv_heads, hidden_dim, rope_theta, tied, moe_inter_dim, num_experts, top_k)
TORCHTITAN_FLAVORS = {
    "debugmodel": (256, 8, 16, 8, 3072, 1e6, True, None, None, None),
    "0.6B": (1024, 28, 16, 8, 3072, 1e6, True, None, None, None),
    "1.7B": (2048, 28, 16, 8, 6144, 1e6, True, None, None, None),
    "4B": (2560, 36, 32, 8, 9728, 1e6, True, None, None, None),
    "8B": (4096, 36, 32, 8, 12288, 1e6, False, None, None, None),
    "14B": (5120, 40, 40, 8, 17408, 1e6, False, None, None, None),
    "32B": (5120, 64, 64, 8, 25600, 1e6, False, None, None, None),
    "debugmodel_moe": (256, 8, 16, 8, 3072, 1e6, False, 768, 64, 8),
    "30B-A3B": (2048, 48, 32, 4, 6144, 1e6, False, 768, 128, 8),
    "235B-A22B": (4096, 94, 64, 4, 12288, 5e6, False, 1536, 128, 8),
}


def _row(a: Qwen3ModelArgs) -> tuple[object, ...]:
    moe = (a.moe_inter_dim, a.moe_args.num_experts, a.moe_args.top_k) if a.moe_enabled else (None, None, None)
    return (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim, a.rope_theta, a.enable_weight_tying, *moe)


def test_flavors_are_torchtitans() -> None:
    assert {name: _row(a) for name, a in qwen3_configs.items()} == TORCHTITAN_FLAVORS
    for name, a in qwen3_configs.items():
        assert (a.head_dim, a.qk_norm, a.norm_eps) == (128, True, 1e-6), name
        assert a.vocab_size == (2048 if name.startswith("debugmodel") else 151936), name
        assert a.max_seq_len == (262144 if name == "30B-A3B" else 4096), name
        if a.moe_enabled:
            m = a.moe_args
            assert (m.score_func, m.route_norm, m.score_before_experts, m.num_shared_experts) == (
                "softmax", True, False, 0), name  # fmt: skip


def test_flavors_import_without_torch() -> None:
    code = "import sys, models.qwen3 as q; q.qwen3_configs['4B'].parameter_count; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parameter_counts_are_the_published_ones() -> None:
    """Qwen3 report: 0.6B (0.44B without embeddings, tied), 30B-A3B 30.5B total / 3.3B active."""
    small, moe = qwen3_configs["0.6B"], qwen3_configs["30B-A3B"]
    assert small.parameter_count == 596_049_920
    assert small.parameter_count - small.vocab_size * small.dim == pytest.approx(0.44e9, rel=0.01)
    assert small.active_parameter_count == small.parameter_count
    assert moe.parameter_count == pytest.approx(30.5e9, rel=0.002)
    assert moe.active_parameter_count == pytest.approx(3.3e9, rel=0.02)
    assert qwen3_configs["235B-A22B"].parameter_count == pytest.approx(235e9, rel=0.002)


@pytest.mark.parametrize("name", ["debugmodel", "8B", "debugmodel_moe", "30B-A3B"])
def test_parameter_shapes_are_the_models(name: str) -> None:
    args = dataclasses.replace(qwen3_configs[name], n_layers=2, vocab_size=100)
    with torch.device("meta"):
        model = Qwen3Model(args)
    saved = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        del saved["output.weight"]  # the embedding's, saved once
    assert parameter_shapes(args) == saved  # with the MoE's routing bias (a buffer) when balancing is on
    assert ("layers.1.moe.expert_bias" in saved) == args.moe_enabled  # the flavors balance (torchtitan's default)
    assert args.parameter_count == sum(p.numel() for p in model.parameters())
    unbalanced = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, load_balance_coeff=None))
    assert not any(hf.not_in_hf(k, args) for k in parameter_shapes(unbalanced))
    assert [k for k in parameter_shapes(args) if hf.not_in_hf(k, args)] == [
        f"layers.{i}.moe.expert_bias" for i in range(2) if args.moe_enabled
    ]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"n_heads": 6, "n_kv_heads": 4}, r"n_heads\(6\) must be divisible by n_kv_heads\(4\)"),
        ({"head_dim": 15}, r"head_dim\(15\) must be even"),
        ({"attn_mask_type": "document"}, r"attn_mask_type='document': expected one of \('causal', 'block_causal'\)"),
        ({"moe_enabled": True, "moe_inter_dim": 0}, r"moe_inter_dim\(0\)"),
    ],
)
def test_bad_args_name_the_field(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Qwen3ModelArgs(**change)  # type: ignore[arg-type]


def test_bad_moe_args_name_the_field() -> None:
    args = Qwen3ModelArgs(moe_enabled=True)
    args.moe_args.top_k = 9
    with pytest.raises(ValueError, match=r"moe_args.top_k\(9\)"):
        args.check()


# --------------------------------------------------------------------------------------- adapter
DENSE_ARGS = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, hidden_dim=96)
MOE_ARGS = dataclasses.replace(DENSE_ARGS, moe_enabled=True, moe_inter_dim=32,
                          moe_args=MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax",
                                           score_before_experts=False, load_balance_coeff=None))  # fmt: skip


def test_names_map_both_ways_and_experts_stack() -> None:
    for args in (DENSE_ARGS, MOE_ARGS):
        for fqn in parameter_shapes(args):
            stacked = hf.stacked_hf_names(fqn, args)
            if stacked is None:
                assert hf.from_hf_name(hf.to_hf_name(fqn)) == fqn
            else:
                assert [hf.from_hf_name(n) for n in stacked] == [fqn] * 4
                with pytest.raises(KeyError, match="stacked_hf_names"):
                    hf.to_hf_name(fqn)
    assert hf.to_hf_name("layers.1.attention.q_norm.weight") == "model.layers.1.self_attn.q_norm.weight"
    assert hf.to_hf_name("layers.0.moe.router.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert hf.stacked_hf_names("layers.1.moe.experts.w2", MOE_ARGS) == [
        f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)
    ]
    assert hf.layer_of("model.layers.1.mlp.experts.3.up_proj.weight") == 1
    assert hf_adapter("qwen3") is hf_adapter("qwen3_moe") is hf.QWEN3_HF_ADAPTER


def test_qk_norm_permutation_commutes_with_rms_norm_and_rope() -> None:
    """HF's q_norm then rotate_half RoPE on permuted channels == ours on the original channels, permuted."""
    heads, head_dim, seq = 3, 8, 5
    x, w = torch.randn(2, seq, heads, head_dim), torch.randn(head_dim)  # (B, T, H, Dh)
    norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    freqs_cis = precompute_freqs_cis(head_dim, seq, 1e6)
    ours, _ = apply_rotary_emb(norm(x), norm(x), freqs_cis)

    def permute(t: torch.Tensor) -> torch.Tensor:  # the row permutation, applied to channels
        return hf.permute_to_hf(t.reshape(-1, heads * head_dim).T, heads).T.reshape(t.shape)

    with torch.no_grad():
        norm.weight.copy_(hf.to_hf_tensor("layers.0.attention.q_norm.weight", w, MOE_ARGS))
    x_hf = norm(permute(x))
    cos = torch.cat([freqs_cis.real, freqs_cis.real], -1)[None, :, None]  # (1, T, 1, Dh)
    sin = torch.cat([freqs_cis.imag, freqs_cis.imag], -1)[None, :, None]
    rotate_half = torch.cat([-x_hf[..., head_dim // 2 :], x_hf[..., : head_dim // 2]], -1)
    torch.testing.assert_close(x_hf * cos + rotate_half * sin, permute(ours))
    assert torch.equal(hf.permute_from_hf(hf.permute_to_hf(w, 1), 1), w)


@pytest.mark.parametrize("name", sorted(qwen3_configs))
def test_hf_config_round_trips_every_flavor(name: str) -> None:
    args = qwen3_configs[name]
    config = hf.hf_config(args, dtype="bfloat16")
    back = hf.args_from_hf_config(json.loads(json.dumps(config)))
    assert hf.closest_flavor(back) == name
    assert back.max_seq_len == args.max_seq_len and back.vocab_size == args.vocab_size
    if args.moe_enabled:
        assert back.moe_args.load_balance_coeff is None  # HF routes without a bias
        assert dataclasses.replace(back.moe_args, load_balance_coeff=1e-3) == args.moe_args
    assert hf.model_args_from_json(json.loads(json.dumps(hf.model_args_to_json(back)))) == back


def test_hf_config_is_what_transformers_loads(tmp_path) -> None:
    for args, cls in ((DENSE_ARGS, "Qwen3Config"), (MOE_ARGS, "Qwen3MoeConfig")):
        (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(args, dtype="float32")))
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        assert type(config).__name__ == cls
        assert config.rope_parameters["rope_theta"] == args.rope_theta
        assert hf.args_from_hf_config(config.to_dict()) == args


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "mistral"}, "model_type is 'mistral', expected 'qwen3'"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: meshtrain's Qwen3-MoE has an MoE in every layer"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2: meshtrain's Qwen3-MoE has an MoE in every layer"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling="),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type='yarn'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
    ],
)
def test_from_hf_config_refuses_what_our_model_cannot_express(change: dict[str, object], needle: str) -> None:
    config = {**hf.hf_config(MOE_ARGS, dtype="float32"), **change}
    with pytest.raises(ValueError, match=needle):
        Qwen3ModelArgs.from_hf_config(config)


def test_hf_config_refuses_routing_hf_cannot_express() -> None:
    args = dataclasses.replace(MOE_ARGS, moe_args=dataclasses.replace(MOE_ARGS.moe_args, score_func="sigmoid"))
    with pytest.raises(ValueError, match="moe_args.score_func='sigmoid'"):
        hf.hf_config(args, dtype="float32")


# ------------------------------------------------------------------------------ against transformers
def build_hf_model(moe: bool, *, tied: bool = False, top_k: int = 2, norm_topk_prob: bool = True) -> torch.nn.Module:
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tied,
                  initializer_range=0.1, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, num_experts=6, num_experts_per_tok=top_k,
                                             moe_intermediate_size=32, norm_topk_prob=norm_topk_prob)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    with torch.no_grad():  # QK norms and layer norms away from ones, so their permutation is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def hub_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The hub's per-expert names of a transformers-5 model's state dict (it fuses each layer's experts into
    `mlp.experts.gate_up_proj` (E, 2H, D), gate rows first, and `mlp.experts.down_proj` (E, D, H))."""
    hub = {}
    for name, w in model.state_dict().items():
        prefix, _, last = name.rpartition(".experts.")
        if last == "gate_up_proj":
            gate, up = w.chunk(2, dim=1)  # (E, H, D) each
            for e in range(w.shape[0]):
                hub[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e]
                hub[f"{prefix}.experts.{e}.up_proj.weight"] = up[e]
        elif last == "down_proj":
            hub.update({f"{prefix}.experts.{e}.down_proj.weight": d for e, d in enumerate(w)})
        else:
            hub[name] = w
    return hub


def ours_from_hub(hub: dict[str, torch.Tensor], config: dict[str, object]) -> Qwen3Model:
    """Our model of HF's `config`, every parameter mapped from the hub tensors through the adapter."""
    args = Qwen3ModelArgs.from_hf_config(config)
    model = Qwen3Model(args)
    params = dict(model.named_parameters())
    assert set(params) == set(parameter_shapes(args))
    with torch.no_grad():
        for fqn, p in params.items():
            names = hf.stacked_hf_names(fqn, args)
            w = torch.stack([hub[n] for n in names]) if names else hub[hf.to_hf_name(fqn)]
            p.copy_(hf.from_hf_tensor(fqn, w, args))
    return model


CASES = {
    "dense": dict(moe=False),
    "dense_tied": dict(moe=False, tied=True),
    "moe_top2_norm": dict(moe=True, top_k=2, norm_topk_prob=True),
    "moe_top3_raw": dict(moe=True, top_k=3, norm_topk_prob=False),
    "moe_top4_norm_tied": dict(moe=True, top_k=4, norm_topk_prob=True, tied=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_gradients_are_transformers(case: str) -> None:
    theirs = build_hf_model(**CASES[case])  # type: ignore[arg-type]
    ours = ours_from_hub(hub_state(theirs), theirs.config.to_dict())
    assert ours.model_args.tie_word_embeddings == CASES[case].get("tied", False)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    want = theirs(input_ids=tokens).logits
    got = ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.std() > 0.1  # not a trivially small output

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    loss(want).backward()
    loss(got).backward()
    grads = {  # ours -> theirs, layouts alike
        ours.tok_embeddings.weight: theirs.model.embed_tokens.weight,
        ours.layers["1"].attention.wo.weight: theirs.model.layers[1].self_attn.o_proj.weight,
        ours.layers["0"].attention.wv.weight: theirs.model.layers[0].self_attn.v_proj.weight,
    }
    if CASES[case]["moe"]:
        grads[ours.layers["0"].moe.router.gate.weight] = theirs.model.layers[0].mlp.gate.weight
        grads[ours.layers["1"].moe.experts.w2] = theirs.model.layers[1].mlp.experts.down_proj
    for mine, hf_param in grads.items():
        assert mine.grad is not None and hf_param.grad is not None
        torch.testing.assert_close(mine.grad, hf_param.grad, atol=1e-5, rtol=1e-4)
    q_hf = theirs.model.layers[0].self_attn.q_proj.weight.grad
    q_ours = hf.to_hf_tensor("layers.0.attention.wq.weight", ours.layers["0"].attention.wq.weight.grad, ours.model_args)
    torch.testing.assert_close(q_ours, q_hf, atol=1e-5, rtol=1e-4)


def test_debugmodel_moe_trains_one_step() -> None:
    """The MoE debug flavor (two of its eight layers, 64 experts, top 8) at 32 tokens: finite loss, a gradient for
    every parameter, a lower loss after one AdamW step on the same batch."""
    torch.manual_seed(0)
    args = dataclasses.replace(qwen3_configs["debugmodel_moe"], n_layers=2, max_seq_len=32)
    model = Qwen3Model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        logits = model(tokens[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item()

    first = step()
    assert math.isfinite(first)
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.isfinite().all()]
    assert missing == []
    assert model.layers["0"].moe.tokens_per_expert.sum() == 2 * 16 * 8  # every token routed to top_k experts
    optimizer.step()
    optimizer.zero_grad()
    assert step() < first
