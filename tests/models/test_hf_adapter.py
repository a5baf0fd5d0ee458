"""models/llama3/hf_adapter.py without files: names, the rotary permutation against HF's
rotate_half math, config.json <-> args for every flavor, Llama 3.1 RoPE scaling, and the adapter object
that models/hf_adapters.py finds for "llama3" / "llama"."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.common.rope import apply_rotary_emb, precompute_freqs_cis, scale_rope_freqs
from models.hf_adapters import hf_adapter
from models.llama3 import RoPEScalingArgs, Transformer, TransformerModelArgs, llama3_configs, parameter_shapes
from models.llama3 import hf_adapter as hf

ARGS = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=32)


def test_names_map_both_ways_for_every_parameter() -> None:
    fqns = list(Transformer(ARGS).state_dict())
    names = [hf.to_hf_name(k) for k in fqns]
    assert "model.layers.1.mlp.gate_proj.weight" == hf.to_hf_name("layers.1.feed_forward.w1.weight")
    assert "model.layers.0.post_attention_layernorm.weight" == hf.to_hf_name("layers.0.ffn_norm.weight")
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(names)
    assert [hf.from_hf_name(n) for n in names] == fqns
    with pytest.raises(KeyError, match="self_attn.q_norm.weight"):
        hf.from_hf_name("model.layers.0.self_attn.q_norm.weight")


def test_parameter_shapes_are_the_models() -> None:
    for args in (ARGS, llama3_configs["8B"], dataclasses.replace(llama3_configs["70B"], n_layers=1)):
        with torch.device("meta"):
            model = Transformer(args)
        assert parameter_shapes(args) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_parameter_count_is_the_models_and_the_published_one() -> None:
    """Counted from the shapes without torch (the pre-flight's memory floor): the model's own parameters for
    every flavor (the tied 1B's shared table once), and Llama 3.1's published counts at its vocabulary."""
    for name, flavor in llama3_configs.items():
        args = dataclasses.replace(flavor, n_layers=2, vocab_size=1000)
        with torch.device("meta"):
            model = Transformer(args)
        assert args.parameter_count == sum(p.numel() for p in model.parameters()), name
    published = {"8B": 8_030_261_248, "70B": 70_553_706_496, "405B": 405_853_388_800}
    assert {name: llama3_configs[name].parameter_count for name in published} == published


def test_permutation_turns_interleaved_rope_into_rotate_half() -> None:
    """Our complex-pair rotary on x equals HF's rotate_half rotary on the permuted channels."""
    heads, head_dim, seq = 3, 8, 5
    x = torch.randn(2, seq, heads, head_dim)  # (B, T, H, Dh)
    freqs_cis = precompute_freqs_cis(head_dim, seq, 10000.0)
    ours, _ = apply_rotary_emb(x, x, freqs_cis)
    # HF: channel i pairs with i + Dh/2; cos/sin repeated over the two halves
    cos = torch.cat([freqs_cis.real, freqs_cis.real], -1)[None, :, None]  # (1, T, 1, Dh)
    sin = torch.cat([freqs_cis.imag, freqs_cis.imag], -1)[None, :, None]

    def permute(t: torch.Tensor) -> torch.Tensor:  # the row permutation, applied to channels
        return hf.permute_to_hf(t.reshape(-1, heads * head_dim).T, heads).T.reshape(t.shape)

    x_hf = permute(x)
    rotate_half = torch.cat([-x_hf[..., head_dim // 2 :], x_hf[..., : head_dim // 2]], -1)
    torch.testing.assert_close(x_hf * cos + rotate_half * sin, permute(ours))


def test_permutation_is_inverted_bitwise_and_uses_the_kv_heads_for_wk() -> None:
    w = torch.randn(4 * 16, 64)
    assert torch.equal(hf.permute_from_hf(hf.permute_to_hf(w, 4), 4), w)
    wk = torch.randn(2 * 16, 64)
    assert torch.equal(hf.to_hf_tensor("layers.0.attention.wk.weight", wk, ARGS), hf.permute_to_hf(wk, 2))
    assert not torch.equal(hf.permute_to_hf(wk, 2), hf.permute_to_hf(wk, 4))
    assert hf.to_hf_tensor("layers.0.attention.wv.weight", wk, ARGS) is wk


# debugmodel_flex_attn is debugmodel's shape with the block-causal mask, which a Hugging Face config does not carry
SHAPES = sorted(name for name in llama3_configs if name != "debugmodel_flex_attn")


@pytest.mark.parametrize("name", SHAPES)
def test_hf_config_round_trips_every_flavor(name: str) -> None:
    args = llama3_configs[name]
    config = hf.hf_config(args, dtype="bfloat16")
    back = hf.args_from_hf_config(config)
    assert back.ffn_hidden_dim == args.ffn_hidden_dim == config["intermediate_size"]
    assert hf.closest_flavor(back) == name
    assert hf.hf_config(back, dtype="bfloat16") == config


@pytest.mark.parametrize("name", SHAPES)
def test_from_hf_config_is_the_adapters_reading_of_every_flavor(name: str) -> None:
    config = hf.hf_config(llama3_configs[name], dtype="bfloat16")
    args = TransformerModelArgs.from_hf_config(config)
    assert args == hf.args_from_hf_config(config)
    assert hf.closest_flavor(args) == name


def test_from_hf_config_reads_a_custom_shape_and_refuses_what_the_model_lacks() -> None:
    config = hf.hf_config(ARGS, dtype="float32")
    assert TransformerModelArgs.from_hf_config(config) == ARGS
    with pytest.raises(ValueError, match="attention_bias=true"):
        TransformerModelArgs.from_hf_config(config | {"attention_bias": True})


def test_hf_config_describes_rope_scaling_and_reads_both_transformers_formats() -> None:
    scaled = dataclasses.replace(llama3_configs["8B"], rope_scaling=RoPEScalingArgs(), max_seq_len=131072)
    config = hf.hf_config(scaled, dtype="bfloat16")
    assert config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert hf.args_from_hf_config(config) == scaled
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**config["rope_scaling"], "rope_theta": 500000.0}
    assert hf.args_from_hf_config(v5) == scaled
    assert hf.closest_flavor(scaled) == "8B"  # Llama 3.1 8B's config.json: the 8B flavor (scaled, as torchtitan's)
    assert hf.closest_flavor(dataclasses.replace(scaled, rope_scaling=None)) == "custom"  # Llama 3 8B: not one


def test_intermediate_sizes_no_flavor_uses_are_matched_exactly() -> None:
    for dim, width in ((64, 1000), (64, 8), (2048, 8192), (3072, 8192)):
        config = hf.hf_config(dataclasses.replace(ARGS, dim=dim), dtype="float32") | {"intermediate_size": width}
        assert hf.args_from_hf_config(config).ffn_hidden_dim == width


def test_model_args_json_round_trips() -> None:
    args = dataclasses.replace(ARGS, rope_scaling=RoPEScalingArgs(scaling_factor=32.0))
    assert hf.model_args_from_json(hf.model_args_to_json(args)) == args
    with pytest.raises(TypeError, match="unknown fields \\['n_experts'\\]"):
        hf.model_args_from_json({**hf.model_args_to_json(args), "n_experts": 8})


def test_rope_scaling_keeps_high_divides_low_and_interpolates_between() -> None:
    scaling = RoPEScalingArgs()
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    scaled = scale_rope_freqs(freqs, scaling)
    wavelen = 2 * math.pi / freqs
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert torch.equal(scaled[high], freqs[high])
    torch.testing.assert_close(scaled[low], freqs[low] / 8)
    mid = ~high & ~low
    assert mid.any() and ((scaled[mid] < freqs[mid]) & (scaled[mid] > freqs[mid] / 8)).all()


def test_rope_scaling_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled = dataclasses.replace(llama3_configs["8B"], rope_scaling=RoPEScalingArgs(), max_seq_len=131072)
    config = transformers.LlamaConfig(**hf.hf_config(scaled, dtype="float32"))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = precompute_freqs_cis(scaled.head_dim, 2, scaled.rope_theta, scaled.rope_scaling)
    torch.testing.assert_close(ours[1].angle(), inv_freq, rtol=1e-6, atol=0)


def test_rope_scaling_off_is_the_plain_table() -> None:
    assert llama3_configs["debugmodel"].rope_scaling is None and llama3_configs["8B"].rope_scaling == RoPEScalingArgs()
    plain = precompute_freqs_cis(128, 64, 500000.0)
    assert torch.equal(precompute_freqs_cis(128, 64, 500000.0, None), plain)
    assert not torch.equal(precompute_freqs_cis(128, 64, 500000.0, RoPEScalingArgs()), plain)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without 'low_freq_factor'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_hf_configs_are_refused_with_the_reason(change: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", "\\[")):
        hf.args_from_hf_config(hf.hf_config(ARGS, dtype="float32") | change)


def test_rope_scaling_args_are_validated() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        RoPEScalingArgs(low_freq_factor=4.0, high_freq_factor=4.0)


def test_the_registry_finds_llamas_adapter_by_model_name_and_model_type() -> None:
    assert hf_adapter("llama3") is hf.LLAMA3_HF_ADAPTER and hf_adapter("llama") is hf.LLAMA3_HF_ADAPTER
    with pytest.raises(ValueError, match=r"no Hugging Face adapter for 'mistral': known .* \[.*'llama', 'llama3'.*\]"):
        hf_adapter("mistral")


def test_the_adapter_is_the_modules_functions() -> None:
    adapter, wq = hf.LLAMA3_HF_ADAPTER, "layers.1.attention.wq.weight"
    assert adapter.name == "llama3" and adapter.flavors is llama3_configs
    assert adapter.to_hf_name(wq) == hf.to_hf_name(wq) and adapter.from_hf_name(hf.to_hf_name(wq)) == wq
    assert adapter.to_hf_name(adapter.output_fqn) == "lm_head.weight"
    assert set(parameter_shapes(ARGS)) >= {adapter.output_fqn, adapter.embedding_fqn}
    assert adapter.rotary_head_dim(wq, ARGS) == ARGS.head_dim == 16
    assert adapter.rotary_head_dim("layers.1.attention.wv.weight", ARGS) is None
    w = torch.randn(2 * 16, 8)  # two whole heads, as a sharded load reads them
    assert torch.equal(adapter.permute_from_hf(hf.permute_to_hf(w, 2), 2), w)
