"""DeepSeek-V3 (models/deepseek_v3): the flavors against torchtitan v0.2's, parameter counts against the published
ones, YaRN against a direct transcription of DeepSeek's reference, argument errors, the HF adapter's names, and the
logits of our model filled from a Hugging Face `DeepseekV3ForCausalLM` state dict equal to transformers' in fp32
over the features the config can switch (query LoRA, node-limited routing, shared experts, dense blocks, score
normalization, the correction bias, YaRN); a one-step training smoke of the debug model."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from models.common.moe_args import MoEArgs
from models.common.rope import rope_frequencies, yarn_mscale, yarn_scale_freqs
from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, deepseek_v3_configs, parameter_shapes
from models.deepseek_v3 import hf_adapter as hf
from models.hf_adapters import hf_adapter

# torchtitan v0.2's deepseekv3_args (torchtitan/models/deepseek_v3/__init__.py), field by field
_TORCHTITAN = {
    "debugmodel": dict(vocab_size=2048, dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=6, n_dense_layers=1,
                       n_heads=16, num_experts=8, num_shared_experts=2, top_k=3, score_func="softmax",
                       route_norm=False, route_scale=1.0, n_expert_groups=1, n_limited_groups=1, q_lora_rank=0,
                       mscale=0.70),
    "16B": dict(vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
                n_heads=16, num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                route_scale=1.0, n_expert_groups=1, n_limited_groups=1, q_lora_rank=0, mscale=0.70),
    "236B": dict(vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60, n_dense_layers=1,
                 n_heads=128, num_experts=160, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                 route_scale=16.0, n_expert_groups=8, n_limited_groups=3, q_lora_rank=1536, mscale=1.0),
    "671B": dict(vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
                 n_heads=128, num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
                 route_scale=2.5, n_expert_groups=8, n_limited_groups=4, q_lora_rank=1536, mscale=1.0),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_TORCHTITAN))
def test_flavor_values_are_torchtitans(name: str) -> None:
    args = deepseek_v3_configs[name]
    moe_fields = {f.name for f in dataclasses.fields(MoEArgs)}
    for key, value in _TORCHTITAN[name].items():
        ours = getattr(args.moe_args if key in moe_fields else args, key)
        assert ours == value, f"{name}.{key}: {ours} != torchtitan's {value}"
    assert not args.moe_args.score_before_experts
    assert (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim) == (512, 128, 64, 128)
    # torchtitan trains these block-causal with flex attention; ours keep the causal defaults (set the two keys)
    assert (args.use_flex_attn, args.attn_mask_type) == (False, "causal")
    assert set(deepseek_v3_configs) == set(_TORCHTITAN)


def test_parameter_counts_are_the_published_ones() -> None:
    """671B: 671B total, 37B active per token (the DeepSeek-V3 report, without the MTP module); 16B: 15.7B
    (DeepSeek-V2-Lite's shape)."""
    big, small = deepseek_v3_configs["671B"], deepseek_v3_configs["16B"]
    assert 670e9 < big.parameter_count < 672e9
    assert 37e9 < big.active_parameter_count < 38e9
    assert 15.6e9 < small.parameter_count < 15.8e9
    assert small.active_parameter_count < 3e9


def test_parameter_shapes_are_the_models() -> None:
    for flavor in ("debugmodel", "236B", "671B"):
        args = dataclasses.replace(deepseek_v3_configs[flavor], n_layers=4, vocab_size=100, max_seq_len=16)
        with torch.device("meta"):
            model = DeepSeekV3Model(args)
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert parameter_shapes(args) == state, flavor
        buffers = sum(v.numel() for k, v in model.state_dict().items() if k.endswith("expert_bias"))
        assert args.parameter_count == sum(p.numel() for p in model.parameters()), flavor
        assert buffers == args.moe_args.num_experts * (4 - args.n_dense_layers)


def test_yarn_matches_a_direct_transcription_of_deepseeks_reference() -> None:
    dim, theta, factor, original, fast, slow = 64, 10000.0, 40.0, 4096, 32, 1
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(correction(fast)), 0), min(math.ceil(correction(slow)), dim - 1)
    smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    expected = base / factor * (1 - smooth) + base * smooth
    ours = yarn_scale_freqs(
        rope_frequencies(dim, theta),
        dim=dim,
        theta=theta,
        factor=factor,
        original_seq_len=original,
        beta_fast=fast,
        beta_slow=slow,
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert ours[0] == base[0] and ours[-1] == base[-1] / factor  # fastest kept, slowest interpolated
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1)
    assert yarn_mscale(1.0, 5.0) == 1.0


def test_yarn_applies_only_beyond_the_original_context() -> None:
    base = dict(dim=32, n_layers=1, n_heads=2, vocab_size=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, inter_dim=32, moe_inter_dim=16, original_seq_len=32)  # fmt: skip
    plain = DeepSeekV3Model(DeepSeekV3ModelArgs(**base, max_seq_len=32))
    yarn = DeepSeekV3Model(DeepSeekV3ModelArgs(**base, max_seq_len=64, mscale=0.7))
    assert plain.layers["0"].attention.softmax_scale_correction == 1.0
    assert yarn.layers["0"].attention.softmax_scale_correction == pytest.approx(yarn_mscale(40.0, 0.7) ** 2)
    assert not torch.equal(plain.freqs_cis, yarn.freqs_cis[:32])


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(attn_mask_type="document"), r"attn_mask_type='document': expected one of \('causal', 'block_causal'\)"),
        (dict(n_dense_layers=7), r"n_dense_layers\(7\).*n_layers\(6\)"),
        (dict(qk_rope_head_dim=63), r"qk_rope_head_dim\(63\) must be even"),
        (dict(n_expert_groups=3, n_limited_groups=2), r"num_expert_groups\(3\) must divide num_experts\(8\)"),
        (dict(n_limited_groups=2), r"n_limited_groups\(2\) needs n_expert_groups > 1"),
        (dict(rope_factor=0.5), r"rope_factor\(0.5\) must be >= 1"),
    ],
)
def test_bad_args_name_the_field(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(deepseek_v3_configs["debugmodel"], **changes)


def test_names_map_both_ways_and_experts_stack() -> None:
    args = _args_of(_hf_config(q_lora_rank=8))
    fqns = list(parameter_shapes(args))
    stacked = {k: hf.stacked_hf_names(k, args) for k in fqns}
    single = [k for k, names in stacked.items() if names is None]
    assert [hf.from_hf_name(hf.to_hf_name(k)) for k in single] == single
    assert hf.to_hf_name("layers.1.moe.expert_bias") == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hf.to_hf_name("layers.0.attention.q_norm.weight") == "model.layers.0.self_attn.q_a_layernorm.weight"
    assert stacked["layers.1.moe.experts.w2"] == [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)]
    experts = [f"layers.{n}.moe.experts.w{i}" for n in (1, 2) for i in (1, 2, 3)]
    assert sorted(k for k, names in stacked.items() if names) == experts
    assert hf.from_hf_name("model.layers.1.mlp.experts.3.gate_proj.weight") == "layers.1.moe.experts.w1"
    with pytest.raises(KeyError, match="is the stack of one HF tensor per expert"):
        hf.to_hf_name("layers.1.moe.experts.w1")
    assert hf_adapter("deepseek_v3") is hf.DEEPSEEK_V3_HF_ADAPTER


def test_model_args_json_round_trip_and_flavor() -> None:
    for name, flavor in deepseek_v3_configs.items():
        assert hf.model_args_from_json(hf.model_args_to_json(flavor)) == flavor
        assert hf.closest_flavor(dataclasses.replace(flavor, vocab_size=7, max_seq_len=9)) == name
    assert hf.closest_flavor(dataclasses.replace(deepseek_v3_configs["16B"], n_layers=3)) == "custom"
    with pytest.raises(TypeError, match="moe_args.bogus"):
        hf.model_args_from_json({**hf.model_args_to_json(deepseek_v3_configs["16B"]), "moe_args": {"bogus": 1}})


def test_from_hf_config_refuses_what_our_model_lacks() -> None:
    cases = [
        (dict(moe_layer_freq=2), "moe_layer_freq=2"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=true"),
        (dict(rope_interleave=False), "rope_interleave=false"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope type 'linear'"),
        (dict(rope_scaling=_yarn(mscale=1.0, mscale_all_dim=0.5)), r"mscale\(1.0\) != mscale_all_dim\(0.5\)"),
        (dict(rope_scaling=_yarn(original_max_position_embeddings=64)), r"max_position_embeddings\(64\) <= original"),
    ]
    for changes, match in cases:
        with pytest.raises(ValueError, match=match):
            _args_of(_hf_config(**changes))


def test_hf_config_refuses_softmax_scores() -> None:
    with pytest.raises(ValueError, match="score_func='softmax': HF's DeepseekV3 router scores with sigmoid only"):
        hf.hf_config(deepseek_v3_configs["16B"], dtype="bfloat16")
    config = hf.hf_config(deepseek_v3_configs["671B"], dtype="bfloat16")
    assert (config["n_group"], config["topk_group"], config["q_lora_rank"]) == (8, 4, 1536)
    assert config["rope_scaling"]["mscale_all_dim"] == config["rope_scaling"]["mscale"] == 1.0


# ------------------------------------------------------------------------------- against transformers
def _yarn(**changes: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, **changes}  # fmt: skip


def _hf_config(**changes: Any) -> dict[str, Any]:
    """A tiny HF DeepSeek-V3 config.json: 3 blocks (the first dense), 8 experts, top-2."""
    return {"model_type": "deepseek_v3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": None,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            **changes}  # fmt: skip


def _args_of(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs.from_hf_config(config)


def hf_to_ours(hf_state: dict[str, torch.Tensor], args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict from HF's hub-format one (per-expert tensors) through the adapter, in memory."""
    ours = {}
    for fqn in parameter_shapes(args):
        names = hf.stacked_hf_names(fqn, args)
        if names is None:
            ours[fqn] = hf.DEEPSEEK_V3_HF_ADAPTER.from_hf_tensor(fqn, hf_state[hf.to_hf_name(fqn)], args)
        else:
            ours[fqn] = torch.stack([hf_state[n] for n in names])
    return ours


def hub_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers-5 model's state dict in the hub format: its fused experts (gate_up_proj (E, 2I, D), down_proj
    (E, D, I)) split into one tensor per expert and projection, as save_pretrained writes them."""
    state = {}
    for name, w in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(expert.chunk(2, dim=0) for expert in w):
                state[f"{prefix}{e}.gate_proj.weight"], state[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            state.update({f"{prefix}{e}.down_proj.weight": w[e] for e in range(w.shape[0])})
        else:
            state[name] = w
    return state


def random_hf_model(config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """transformers' DeepseekV3ForCausalLM of `config` with random weights (a random correction bias too)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


_FEATURES = {
    "plain": {},
    "q_lora": dict(q_lora_rank=12),
    "groups_4_of_2": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    "shared_2_no_norm": dict(n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "all_dense_but_last": dict(first_k_dense_replace=2),
    "yarn": dict(rope_scaling=_yarn(), q_lora_rank=12),
}


@pytest.mark.parametrize("feature", list(_FEATURES))
def test_logits_equal_transformers(feature: str) -> None:
    config = _hf_config(**_FEATURES[feature])
    model_hf = random_hf_model(config)
    args = _args_of(model_hf.config.to_dict())
    assert args.yarn_enabled == (feature == "yarn")
    ours = DeepSeekV3Model(args)
    ours.load_state_dict(hf_to_ours(hub_state_dict(model_hf), args), strict=True)
    tokens = torch.randint(0, config["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model_hf(tokens).logits
        got = ours(tokens)
    assert expected.abs().max() > 1.0  # the check has teeth
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_one_training_step_of_the_debug_model() -> None:
    torch.manual_seed(0)
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], n_layers=3, max_seq_len=64)
    model = DeepSeekV3Model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and 7.0 < loss.item() < 9.0  # about ln(2048) = 7.6 at init
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert model.layers["2"].moe is not None and model.layers["2"].moe.tokens_per_expert.sum() == 2 * 32 * 3
