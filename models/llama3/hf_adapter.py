"""The mapping between our Llama 3 and Hugging Face's `LlamaForCausalLM`: parameter names, the
rotary permutation of the q/k projections, and `config.json` <-> TransformerModelArgs.

Pure functions on single tensors and dicts (imports only torch), so the conversion can stream a
checkpoint one tensor at a time and the mapping is tested without any files. `LLAMA3_HF_ADAPTER`
bundles them as the `HFAdapter` (checkpoint/hf_adapter_protocol.py) that checkpoint.hf_conversion is handed;
`models.hf_adapters` finds it by "llama3" or HF's "llama".

The rotary layouts differ: our model (like Meta's reference and torchtitan) rotates consecutive
channel pairs (2i, 2i+1) of each head by frequency i (a complex multiply); HF's `rotate_half`
rotates channel i with channel i + head_dim/2. Attention scores are invariant to permuting q and k
channels the same way within each head, so converting is a fixed row permutation of wq and wk
(per head: even channels first, then odd), as HF's own `convert_llama_weights_to_hf.py` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from models.common.hf_names import HF_IGNORED_SUFFIXES, HFNames, layer_template

from .args import RoPEScalingArgs, TransformerModelArgs, llama3_configs, parameter_shapes

# our FQN (below "model.") <-> HF name; {} is the layer number
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_NAMES = HFNames("Llama 3", _LAYER_NAMES)


def to_hf_name(fqn: str) -> str:
    """Our FQN (`layers.0.attention.wq.weight`) -> HF's (`model.layers.0.self_attn.q_proj.weight`)."""
    return _NAMES.to_hf(fqn)


def from_hf_name(name: str) -> str:
    """HF's parameter name -> our FQN (KeyError naming the expected names for anything else)."""
    return _NAMES.from_hf(name)


def layer_of(fqn: str) -> int | None:
    """The block number of an FQN in either naming, None outside the blocks."""
    return layer_template(fqn)[1]


# ------------------------------------------------------------------------- rotary permutation
def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq / wk (n_heads * head_dim, dim) from interleaved pairs to HF's half split: within
    each head, row 2i + c moves to c * head_dim/2 + i."""
    rows, cols = w.shape
    # (H, Dh/2, 2, D) -> (H, 2, Dh/2, D)
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    rows, cols = w.shape
    # (H, 2, Dh/2, D) -> (H, Dh/2, 2, D)
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotary_heads(fqn: str, args: TransformerModelArgs) -> int | None:
    """How many heads the rows of `fqn` hold if it is a rotated projection (wq, wk), else None."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    return None


def rotary_head_dim(fqn: str, args: TransformerModelArgs) -> int | None:
    """The rows of one head when `fqn` is a rotated projection (wq, wk), whose rows HF permutes within each
    head; else None."""
    return None if _rotary_heads(fqn, args) is None else args.head_dim


def to_hf_tensor(fqn: str, w: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
    """Our parameter `fqn` as HF stores it (wq / wk rows permuted, everything else as is)."""
    heads = _rotary_heads(fqn, args)
    return w if heads is None else permute_to_hf(w, heads)


def from_hf_tensor(fqn: str, w: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
    """HF's tensor for our parameter `fqn` in our layout (the inverse of `to_hf_tensor`)."""
    heads = _rotary_heads(fqn, args)
    return w if heads is None else permute_from_hf(w, heads)


# ------------------------------------------------------------------------------ config.json
def hf_config(args: TransformerModelArgs, *, dtype: str, tie_word_embeddings: bool | None = None) -> dict[str, Any]:
    """The `config.json` of `LlamaForCausalLM` for `Transformer(args)` stored in `dtype` (tied as
    `args` unless `tie_word_embeddings` says otherwise)."""
    if tie_word_embeddings is None:
        tie_word_embeddings = args.tie_word_embeddings
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads if args.n_kv_heads is None else args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.scaling_factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return config


def args_from_hf_config(config: dict[str, Any]) -> TransformerModelArgs:
    """Our model args for an HF Llama `config.json`; ValueError naming what our model lacks
    (biases, other activations or rope types, a head_dim other than hidden_size / heads)."""
    _check_supported(config)
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    multiple_of, ffn_dim_multiplier = _ffn_shape(dim, int(config["intermediate_size"]))
    theta, scaling = _rope(config)
    args = TransformerModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        vocab_size=int(config["vocab_size"]),
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_dim_multiplier,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    flavor = closest_flavor(args)
    if flavor == "custom":
        return args
    # a published shape: the flavor's own fields (its multiple_of, n_kv_heads spelling)
    return dataclasses.replace(llama3_configs[flavor], vocab_size=args.vocab_size, max_seq_len=args.max_seq_len)


def _check_supported(config: dict[str, Any]) -> None:
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama' (LlamaForCausalLM)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key}=true: our Llama has no biases")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: our SwiGLU uses silu")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={config['partial_rotary_factor']}: our RoPE rotates whole heads")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in config:
            problems.append(f"{key} is missing")
    if not problems and config.get("head_dim") not in (None, config["hidden_size"] // config["num_attention_heads"]):
        problems.append(
            f"head_dim={config['head_dim']} != hidden_size({config['hidden_size']}) / num_attention_heads"
            f"({config['num_attention_heads']}): our attention derives head_dim from them"
        )
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))


def _rope(config: dict[str, Any]) -> tuple[float, RoPEScalingArgs | None]:
    """(rope_theta, scaling) from either transformers 4's `rope_theta` + `rope_scaling` or 5's `rope_parameters`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"unsupported Hugging Face config: rope type {kind!r}; our model implements plain RoPE and Llama 3.1's "
            f"'llama3' scaling only"
        )
    try:
        scaling = RoPEScalingArgs(
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"unsupported Hugging Face config: llama3 rope scaling without {e.args[0]!r}") from None
    return theta, scaling


def _ffn_shape(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which FeedForward builds `intermediate_size`: the
    published flavors' values when one fits, else an exact fallback (multiple_of = the width)."""
    probe = TransformerModelArgs(dim=dim, n_heads=1)
    candidates = [(a.multiple_of, a.ffn_dim_multiplier) for a in llama3_configs.values()]
    candidates += [(m, f) for f in (None, 1.3, 1.5, 1.2) for m in (1024, 512, 256, 128, 64, 32, 16, 8)]
    for multiple_of, multiplier in candidates:
        trial = dataclasses.replace(probe, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if trial.ffn_hidden_dim == intermediate_size:
            return multiple_of, multiplier
    # rounding up to a multiple of the width itself lands on it for any raw width in (0, width]
    raw = int(2 * (4 * dim) / 3)
    return intermediate_size, None if raw <= intermediate_size else intermediate_size / raw


def closest_flavor(args: TransformerModelArgs) -> str:
    """The llama3 flavor whose weights and numerics `args` has, up to vocab_size and max_seq_len
    (the trainer sets both), or "custom"."""
    for name, flavor in llama3_configs.items():
        if _architecture(flavor) == _architecture(args):
            return name
    return "custom"


def _architecture(args: TransformerModelArgs) -> tuple[Any, ...]:
    """What the weights and the forward depend on (not how the FFN width was written, nor init)."""
    n_kv = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    return (args.dim, args.n_layers, args.n_heads, n_kv, args.ffn_hidden_dim, args.norm_eps, args.rope_theta,
            args.rope_scaling, args.tie_word_embeddings)  # fmt: skip


def model_args_to_json(args: TransformerModelArgs) -> dict[str, Any]:
    """`args` as the JSON a checkpoint's metadata stores ("model_args")."""
    return dataclasses.asdict(args)


def model_args_from_json(raw: dict[str, Any]) -> TransformerModelArgs:
    """The inverse of `model_args_to_json`; TypeError naming unknown fields."""
    fields = {f.name for f in dataclasses.fields(TransformerModelArgs)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise TypeError(f"model_args has unknown fields {unknown}; this meshtrain knows {sorted(fields)}")
    scaling = raw.get("rope_scaling")
    return TransformerModelArgs(**{**raw, "rope_scaling": RoPEScalingArgs(**scaling) if scaling else None})


# ---------------------------------------------------------------------------------- adapter
class Llama3HFAdapter:
    """Llama 3 <-> `LlamaForCausalLM` as checkpoint.hf_adapter_protocol.HFAdapter: this module's functions.

    The methods look the functions up when called (patching a function patches the adapter too)."""

    name = "llama3"
    hf_architecture = "LlamaForCausalLM"
    flavors = llama3_configs
    output_fqn = "output.weight"
    embedding_fqn = "tok_embeddings.weight"
    ignored_hf_suffixes = HF_IGNORED_SUFFIXES
    # config.json gives the FFN width, which these spell in several ways
    hf_config_ambiguous_args = frozenset({"multiple_of", "ffn_dim_multiplier"})

    def to_hf_name(self, fqn: str) -> str:
        return to_hf_name(fqn)

    def from_hf_name(self, name: str) -> str:
        return from_hf_name(name)

    def stacked_hf_names(self, fqn: str, args: TransformerModelArgs) -> list[str] | None:
        return None  # every Llama tensor is one HF tensor

    def not_in_hf(self, fqn: str, args: TransformerModelArgs) -> bool:
        return False

    def layer_of(self, fqn: str) -> int | None:
        return layer_of(fqn)

    def to_hf_tensor(self, fqn: str, w: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
        return to_hf_tensor(fqn, w, args)

    def from_hf_tensor(self, fqn: str, w: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
        return from_hf_tensor(fqn, w, args)

    def rotary_head_dim(self, fqn: str, args: TransformerModelArgs) -> int | None:
        return rotary_head_dim(fqn, args)

    def permute_from_hf(self, w: torch.Tensor, n_heads: int) -> torch.Tensor:
        return permute_from_hf(w, n_heads)

    def hf_config(self, args: TransformerModelArgs, *, dtype: str, tie_word_embeddings: bool) -> dict[str, Any]:
        return hf_config(args, dtype=dtype, tie_word_embeddings=tie_word_embeddings)

    def args_from_hf_config(self, config: dict[str, Any]) -> TransformerModelArgs:
        return args_from_hf_config(config)

    def closest_flavor(self, args: TransformerModelArgs) -> str:
        return closest_flavor(args)

    def model_args_to_json(self, args: TransformerModelArgs) -> dict[str, Any]:
        return model_args_to_json(args)

    def model_args_from_json(self, raw: dict[str, Any]) -> TransformerModelArgs:
        return model_args_from_json(raw)

    def parameter_shapes(self, args: TransformerModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(args, output=output)


LLAMA3_HF_ADAPTER = Llama3HFAdapter()
