"""The mapping between our Qwen3 and Hugging Face's `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`: parameter names,
the stacking of per-expert tensors, the rotary permutation, and `config.json` <-> Qwen3ModelArgs.

Pure functions on single tensors and dicts (imports only torch), so the conversion can stream a checkpoint one
tensor at a time and the mapping is tested without files. `QWEN3_HF_ADAPTER` bundles them as the `HFAdapter`
(checkpoint/hf_adapter_protocol.py) that checkpoint.hf_conversion is handed; `models.hf_adapters` finds it by
"qwen3" or "qwen3_moe" (our name and HF's model types).

Two layouts differ from the hub's:
- Rotary pairs: our RoPE rotates consecutive channels (2i, 2i + 1) of each head, HF's `rotate_half` channel i with
  i + head_dim / 2. Attention scores are invariant to permuting q and k channels alike within each head, so wq
  and wk rows are permuted per head (as for Llama, models/llama3/hf_adapter.py). Qwen3 RMS-normalizes each head
  before RoPE with a (head_dim,) weight; RMSNorm commutes with a channel permutation when its weight is permuted
  alike, so q_norm / k_norm weights take the same per-head permutation (one head).
- Experts: the hub stores each routed expert's SwiGLU as three matrices, `mlp.experts.E.{gate,up,down}_proj`;
  our MoE holds them stacked along a new dim 0, `moe.experts.w1 / w3` (E, H, D) and `w2` (E, D, H). Such an FQN
  maps to several HF names (`stacked_hf_names`), never through `to_hf_name`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from models.common.hf_names import HF_IGNORED_SUFFIXES, HFNames, layer_template
from models.common.moe_args import MoEArgs

from .args import Qwen3ModelArgs, is_routing_bias, parameter_shapes, qwen3_configs

# our FQN (below "model.") <-> HF name; {} is the layer number
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_NAMES = HFNames("Qwen3", _LAYER_NAMES)
# our stacked expert weight (below `layers.N.moe.experts.`) <- HF's per-expert projection
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf_name(fqn: str) -> str:
    """Our one-to-one FQN (`layers.0.attention.wq.weight`) -> HF's (`model.layers.0.self_attn.q_proj.weight`);
    KeyError for a stacked expert weight, whose HF names `stacked_hf_names` gives."""
    if _STACKED.match(fqn):
        raise KeyError(f"{fqn!r} is a stack of HF's per-expert tensors: its names are stacked_hf_names({fqn!r})")
    return _NAMES.to_hf(fqn)


def from_hf_name(name: str) -> str:
    """HF's parameter name -> our FQN; a per-expert projection (`model.layers.0.mlp.experts.5.gate_proj.weight`)
    -> the stacked weight it is one slice of (`layers.0.moe.experts.w1`). KeyError for anything else."""
    m = _HF_EXPERT.match(name)
    if m is not None:
        ours = {hf: w for w, hf in _EXPERT_NAMES.items()}[m.group(3)]
        return f"layers.{m.group(1)}.moe.experts.{ours}"
    return _NAMES.from_hf(name)


def stacked_hf_names(fqn: str, args: Qwen3ModelArgs) -> list[str] | None:
    """The HF names whose stack along a new dim 0 is our `fqn`, in expert order (`layers.N.moe.experts.w1`
    (E, H, D) <- `model.layers.N.mlp.experts.{e}.gate_proj.weight` (H, D), e < E; w3 <- up_proj, w2 <-
    down_proj); None for a one-to-one tensor."""
    m = _STACKED.match(fqn)
    if m is None:
        return None
    layer, proj = m.group(1), _EXPERT_NAMES[m.group(2)]
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(args.moe_args.num_experts)]


def not_in_hf(fqn: str, args: Qwen3ModelArgs) -> bool:
    """Whether our saved tensor `fqn` has no place in HF's format: the MoE's load-balancing routing bias
    (`layers.N.moe.expert_bias`), since HF's Qwen3-MoE routes by the scores alone. Reading HF leaves it at zero
    (the same routing); the conversion refuses to write a non-zero one, whose routing HF could not reproduce."""
    return is_routing_bias(fqn)


def layer_of(fqn: str) -> int | None:
    """The block number of an FQN in either naming, None outside the blocks."""
    return layer_template(fqn)[1]


# ------------------------------------------------------------------------- rotary permutation
def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq / wk (n_heads * head_dim, dim), or a QK-norm weight (head_dim,) as one head, from interleaved
    pairs to HF's half split: within each head, row 2i + c moves to c * head_dim/2 + i."""
    rows = w.shape[0]
    # (H, Dh/2, 2, ...) -> (H, 2, Dh/2, ...)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    rows = w.shape[0]
    # (H, 2, Dh/2, ...) -> (H, Dh/2, 2, ...)
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rotary_heads(fqn: str, args: Qwen3ModelArgs) -> int | None:
    """How many heads the rows of `fqn` hold if HF permutes them (wq, wk, the QK norms), else None."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_kv_heads
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one weight, shared by every head
    return None


def rotary_head_dim(fqn: str, args: Qwen3ModelArgs) -> int | None:
    """The rows of one head when HF permutes the rows of `fqn` within each head (wq, wk, q_norm, k_norm)."""
    return None if _rotary_heads(fqn, args) is None else args.head_dim


def to_hf_tensor(fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> torch.Tensor:
    """Our parameter `fqn` as HF stores it (rotary rows permuted, everything else as is; a stacked expert
    weight is returned whole, and its slices w[e] are HF's tensors)."""
    heads = _rotary_heads(fqn, args)
    return w if heads is None else permute_to_hf(w, heads)


def from_hf_tensor(fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> torch.Tensor:
    """HF's tensor for our parameter `fqn` in our layout (the inverse of `to_hf_tensor`)."""
    heads = _rotary_heads(fqn, args)
    return w if heads is None else permute_from_hf(w, heads)


# ------------------------------------------------------------------------------ config.json
def _export_problems(args: Qwen3ModelArgs) -> list[str]:
    """What HF's Qwen3 / Qwen3-MoE cannot express of `args`."""
    problems = []
    if not args.qk_norm:
        problems.append("qk_norm=False (HF's Qwen3 always normalizes q and k)")
    if args.moe_enabled:
        m = args.moe_args
        expected = {"score_func": "softmax", "num_shared_experts": 0, "score_before_experts": False, "route_scale": 1.0,
                    "num_expert_groups": None}  # fmt: skip
        problems += [
            f"moe_args.{key}={getattr(m, key)!r} (HF's Qwen3-MoE has {value!r})"
            for key, value in expected.items()
            if getattr(m, key) != value
        ]
    return problems


def hf_config(args: Qwen3ModelArgs, *, dtype: str, tie_word_embeddings: bool | None = None) -> dict[str, Any]:
    """The `config.json` of `Qwen3ForCausalLM` (or `Qwen3MoeForCausalLM` when `moe_enabled`) for `Qwen3Model(args)`
    stored in `dtype` (tied as `args` unless `tie_word_embeddings` says otherwise). ValueError naming what HF's
    Qwen3 cannot express. The routing bias of load balancing (`expert_bias`) has no key here: HF routes by the
    scores alone (`not_in_hf`; the conversion refuses a non-zero bias)."""
    problems = _export_problems(args)
    if problems:
        raise ValueError("cannot write a Hugging Face Qwen3 config: " + "; ".join(problems))
    if tie_word_embeddings is None:
        tie_word_embeddings = args.tie_word_embeddings
    moe = args.moe_enabled
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # transformers 4 reads rope_theta / rope_scaling, 5 rope_parameters
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
    }
    if moe:
        config.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": args.moe_inter_dim,
            "num_experts": args.moe_args.num_experts,
            "num_experts_per_tok": args.moe_args.top_k,
            "norm_topk_prob": args.moe_args.route_norm,
            "output_router_logits": False,
        })  # fmt: skip
    return config


def args_from_hf_config(config: dict[str, Any]) -> Qwen3ModelArgs:
    """Our model args for an HF Qwen3 or Qwen3-MoE `config.json`; ValueError naming each key our model cannot
    express (biases, other activations, RoPE scaling, sliding windows, dense layers between MoE ones)."""
    _check_supported(config)
    moe = config["model_type"] == "qwen3_moe"
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    moe_kwargs: dict[str, Any] = {}
    if moe:
        moe_kwargs = {
            "moe_inter_dim": int(config["moe_intermediate_size"]),
            "moe_args": MoEArgs(
                num_experts=int(_num_experts(config)),
                num_shared_experts=0,
                top_k=int(config["num_experts_per_tok"]),
                score_func="softmax",
                route_norm=bool(config.get("norm_topk_prob", False)),
                score_before_experts=False,
                # HF's Qwen3-MoE routes by the softmax scores alone: no routing bias, so there is no expert_bias to
                # load and starting from a nonzero one would change the model; balancing (and its bias) is off
                load_balance_coeff=None,
            ),
        }
    params = config.get("rope_parameters") or {}
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        vocab_size=int(config["vocab_size"]),
        head_dim=int(config.get("head_dim") or dim // n_heads),
        hidden_dim=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
        qk_norm=True,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        enable_weight_tying=bool(config.get("tie_word_embeddings", False)),
        moe_enabled=moe,
        **moe_kwargs,
    )


def _num_experts(config: dict[str, Any]) -> Any:
    """The hub's `num_experts`, which transformers 5 writes as `num_local_experts`."""
    return config.get("num_experts", config.get("num_local_experts"))


def _check_supported(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"unsupported Hugging Face config: model_type is {model_type!r}, expected 'qwen3' (Qwen3ForCausalLM) "
            f"or 'qwen3_moe' (Qwen3MoeForCausalLM)"
        )
    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    if model_type == "qwen3_moe":
        required += ["moe_intermediate_size", "num_experts_per_tok"]
    problems = [f"{key} is missing" for key in required if key not in config]
    if model_type == "qwen3_moe" and _num_experts(config) is None:
        problems.append("num_experts is missing")
    if config.get("attention_bias"):
        problems.append("attention_bias=true: our Qwen3 attention has no biases")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: our SwiGLU uses silu")
    if config.get("rope_scaling") is not None:
        problems.append(f"rope_scaling={config['rope_scaling']!r}: our Qwen3 implements plain RoPE only (no YaRN)")
    rope_type = (config.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"rope_parameters.rope_type={rope_type!r}: our Qwen3 implements plain RoPE only (no YaRN)")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=true: our attention is causal over the whole sequence")
    if any(kind != "full_attention" for kind in config.get("layer_types") or []):
        problems.append(f"layer_types={config['layer_types']}: our attention is full causal in every layer")
    if config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={config['mlp_only_layers']}: meshtrain's Qwen3-MoE has an MoE in every layer")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(
            f"decoder_sparse_step={config['decoder_sparse_step']}: meshtrain's Qwen3-MoE has an MoE in every layer "
            f"(decoder_sparse_step=1)"
        )
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))


def closest_flavor(args: Qwen3ModelArgs) -> str:
    """The qwen3 flavor whose weights and numerics `args` has, up to vocab_size and max_seq_len (the trainer sets
    both) and the MoE's training-only settings (load balancing, grouped GEMM), or "custom"."""
    for name, flavor in qwen3_configs.items():
        if _architecture(flavor) == _architecture(args):
            return name
    return "custom"


def _architecture(args: Qwen3ModelArgs) -> tuple[Any, ...]:
    """What the weights and the forward depend on (not init, not how training balances the experts)."""
    dense = (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.norm_eps, args.rope_theta,
             args.qk_norm, args.tie_word_embeddings, args.moe_enabled)  # fmt: skip
    if not args.moe_enabled:
        return (*dense, args.hidden_dim)
    m = args.moe_args
    return (*dense, args.moe_inter_dim, m.num_experts, m.num_shared_experts, m.score_func, m.route_norm,
            m.route_scale, m.score_before_experts, m.top_k, m.num_expert_groups, m.num_limited_groups)  # fmt: skip


def model_args_to_json(args: Qwen3ModelArgs) -> dict[str, Any]:
    """`args` as the JSON a checkpoint's metadata stores ("model_args"); `moe_args` nested as a dict."""
    return dataclasses.asdict(args)


def model_args_from_json(raw: dict[str, Any]) -> Qwen3ModelArgs:
    """The inverse of `model_args_to_json`; TypeError naming unknown fields (of the args or of moe_args)."""
    for cls, given, where in ((Qwen3ModelArgs, raw, "model_args"), (MoEArgs, raw.get("moe_args") or {}, "moe_args")):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - fields)
        if unknown:
            raise TypeError(f"{where} has unknown fields {unknown}; this meshtrain knows {sorted(fields)}")
    moe = raw.get("moe_args")
    return Qwen3ModelArgs(**{**raw, "moe_args": MoEArgs(**moe) if moe is not None else MoEArgs()})


# ---------------------------------------------------------------------------------- adapter
class Qwen3HFAdapter:
    """Qwen3 (dense and MoE) <-> `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` as
    checkpoint.hf_adapter_protocol.HFAdapter: this module's functions.

    The methods look the functions up when called (patching a function patches the adapter too)."""

    name = "qwen3"
    hf_architecture = "Qwen3ForCausalLM / Qwen3MoeForCausalLM"
    flavors = qwen3_configs
    output_fqn = "output.weight"
    embedding_fqn = "tok_embeddings.weight"
    ignored_hf_suffixes = HF_IGNORED_SUFFIXES
    # config.json cannot say whether training balances the experts (HF has no routing bias) nor how it runs them:
    # from_hf_config's load_balance_coeff=None is one spelling among many; the tensors' shapes check num_experts
    hf_config_ambiguous_args = frozenset({"moe_args"})

    def to_hf_name(self, fqn: str) -> str:
        return to_hf_name(fqn)

    def from_hf_name(self, name: str) -> str:
        return from_hf_name(name)

    def stacked_hf_names(self, fqn: str, args: Qwen3ModelArgs) -> list[str] | None:
        return stacked_hf_names(fqn, args)

    def not_in_hf(self, fqn: str, args: Qwen3ModelArgs) -> bool:
        return not_in_hf(fqn, args)

    def layer_of(self, fqn: str) -> int | None:
        return layer_of(fqn)

    def to_hf_tensor(self, fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> torch.Tensor:
        return to_hf_tensor(fqn, w, args)

    def from_hf_tensor(self, fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> torch.Tensor:
        return from_hf_tensor(fqn, w, args)

    def rotary_head_dim(self, fqn: str, args: Qwen3ModelArgs) -> int | None:
        return rotary_head_dim(fqn, args)

    def permute_from_hf(self, w: torch.Tensor, n_heads: int) -> torch.Tensor:
        return permute_from_hf(w, n_heads)

    def hf_config(self, args: Qwen3ModelArgs, *, dtype: str, tie_word_embeddings: bool) -> dict[str, Any]:
        return hf_config(args, dtype=dtype, tie_word_embeddings=tie_word_embeddings)

    def args_from_hf_config(self, config: dict[str, Any]) -> Qwen3ModelArgs:
        return args_from_hf_config(config)

    def closest_flavor(self, args: Qwen3ModelArgs) -> str:
        return closest_flavor(args)

    def model_args_to_json(self, args: Qwen3ModelArgs) -> dict[str, Any]:
        return model_args_to_json(args)

    def model_args_from_json(self, raw: dict[str, Any]) -> Qwen3ModelArgs:
        return model_args_from_json(raw)

    def parameter_shapes(self, args: Qwen3ModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(args, output=output)


QWEN3_HF_ADAPTER = Qwen3HFAdapter()
