"""The mapping between our DeepSeek-V3 and Hugging Face's `DeepseekV3ForCausalLM`: parameter names (the routed
experts stacked on our side, one tensor per expert on HF's), and `config.json` <-> DeepSeekV3ModelArgs.

Pure functions on names, single tensors and dicts (imports only torch), bundled as the `HFAdapter`
(checkpoint/hf_adapter_protocol.py) that checkpoint.hf_conversion is handed; `models.hf_adapters` finds it by
"deepseek_v3", which is both our model.name and HF's model_type.

The rotary layouts agree, so no tensor is permuted: with HF's `rope_interleave=True` (DeepSeek's checkpoints),
HF's `apply_rotary_pos_emb_interleave` rotates consecutive channel pairs (2i, 2i+1) of q_pe / k_pe by frequency i,
as our complex multiply does. It writes the rotated pairs back de-interleaved (all real parts, then all imaginary
parts), but it does so for queries and keys alike, and a score is a dot product, invariant to permuting q and k
channels the same way. `rope_interleave=False` (rotate_half on the same weights) is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch

from models.common.hf_names import HF_IGNORED_SUFFIXES, HFNames, layer_template
from models.common.moe_args import MoEArgs

from .args import DeepSeekV3ModelArgs, deepseek_v3_configs, parameter_shapes

logger = logging.getLogger(__name__)

# HF's DeepseekV3 normalizes the q / kv latents with this epsilon whatever its rms_norm_eps
HF_LATENT_NORM_EPS = 1e-6

# our FQN (below "model.") <-> HF name; {} is the layer number
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_NAMES = HFNames("DeepSeek-V3", _LAYER_NAMES)
# our stacked routed experts (E, H, D) / (E, D, H) <- HF's per-expert projection of that name
_STACKED_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf_name(fqn: str) -> str:
    """Our FQN (`layers.0.attention.wkv_a.weight`) -> HF's (`model.layers.0.self_attn.kv_a_proj_with_mqa.weight`);
    KeyError for the stacked experts, which are several HF tensors (`stacked_hf_names`)."""
    template, layer = layer_template(fqn)
    if template.removeprefix("layers.{}.") in _STACKED_NAMES:
        raise KeyError(f"{fqn!r} is the stack of one HF tensor per expert: see stacked_hf_names")
    return _NAMES.to_hf(fqn)


def from_hf_name(name: str) -> str:
    """HF's parameter name -> our FQN; one expert's projection names the stack it is a row of
    (`model.layers.N.mlp.experts.E.gate_proj.weight` -> `layers.N.moe.experts.w1`); KeyError naming the expected
    names for anything else."""
    expert = _HF_EXPERT.match(name)
    if expert is not None:
        ours = {proj: fqn for fqn, proj in _STACKED_NAMES.items()}[expert.group(3)]
        return f"layers.{expert.group(1)}.{ours}"
    return _NAMES.from_hf(name)


def stacked_hf_names(fqn: str, args: DeepSeekV3ModelArgs) -> list[str] | None:
    """The HF names whose stack along a new dim 0 is our tensor `fqn`, in expert order: `layers.N.moe.experts.w1`
    (E, H, D) stacks `model.layers.N.mlp.experts.{e}.gate_proj.weight` for e < E (w3: up_proj, w2: down_proj).
    None for every tensor that maps one to one (`to_hf_name`)."""
    template, layer = layer_template(fqn)
    proj = _STACKED_NAMES.get(template.removeprefix("layers.{}."))
    if proj is None or layer is None:
        return None
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(args.moe_args.num_experts)]


def layer_of(fqn: str) -> int | None:
    """The block number of an FQN in either naming, None outside the blocks."""
    return layer_template(fqn)[1]


# ------------------------------------------------------------------------------ config.json
def hf_config(args: DeepSeekV3ModelArgs, *, dtype: str, tie_word_embeddings: bool = False) -> dict[str, Any]:
    """The `config.json` of `DeepseekV3ForCausalLM` for `DeepSeekV3Model(args)` stored in `dtype`; ValueError for
    what HF's DeepseekV3 cannot compute (softmax scores, scores before the experts, no shared expert, ties)."""
    moe = args.moe_args
    problems = []
    if moe.score_func != "sigmoid":
        problems.append(
            f"moe_args.score_func={moe.score_func!r}: HF's DeepseekV3 router scores with sigmoid only (torchtitan's "
            f"debugmodel / 16B / 236B flavors use softmax; train with score_func='sigmoid' to export)"
        )
    if moe.score_before_experts:
        problems.append("moe_args.score_before_experts=True: HF's DeepseekV3 scales the experts' outputs")
    if moe.num_shared_experts < 1:
        problems.append("moe_args.num_shared_experts=0: HF's DeepseekV3 always has a shared expert")
    if tie_word_embeddings:
        problems.append("tied embeddings: DeepSeek-V3 has its own lm_head")
    if args.yarn_enabled and args.mscale == 0:
        problems.append("mscale=0 with YaRN: HF would scale the rotary channels by yarn_get_mscale(rope_factor)")
    if problems:
        raise ValueError("cannot export to Hugging Face's DeepseekV3ForCausalLM: " + "; ".join(problems))
    if args.norm_eps != HF_LATENT_NORM_EPS:
        logger.warning(
            "norm_eps=%s: HF's DeepseekV3 normalizes the q / kv latents with eps %s regardless, so its logits differ "
            "slightly from ours",
            args.norm_eps,
            HF_LATENT_NORM_EPS,
        )
    rope_scaling = None
    if args.yarn_enabled:
        rope_scaling = {
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            "mscale": args.mscale,  # equal to mscale_all_dim: HF's rotary attention_factor is then 1
            "mscale_all_dim": args.mscale,
        }
    grouped = args.n_expert_groups > 1
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.route_norm,
        "routed_scaling_factor": moe.route_scale,
        "n_group": args.n_expert_groups if grouped else 1,
        "topk_group": args.n_limited_groups if grouped else 1,
        "moe_layer_freq": 1,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": True,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": dtype,
    }


def args_from_hf_config(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """Our model args for an HF DeepSeek-V3 `config.json`; ValueError naming each key our model cannot express."""
    _check_supported(config)
    n_group = int(config.get("n_group") or 1)
    max_seq_len = int(config.get("max_position_embeddings", 4096))
    if float(config.get("rms_norm_eps", 1e-6)) != HF_LATENT_NORM_EPS:
        logger.warning(
            "rms_norm_eps=%s: our MLA normalizes the q / kv latents with it too, HF's with %s",
            config["rms_norm_eps"],
            HF_LATENT_NORM_EPS,
        )
    moe_args = MoEArgs(
        num_experts=int(config["n_routed_experts"]),
        num_shared_experts=int(config.get("n_shared_experts", 1)),
        top_k=int(config["num_experts_per_tok"]),
        score_func="sigmoid",
        route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        score_before_experts=False,
    )
    q_lora_rank = config.get("q_lora_rank")
    return DeepSeekV3ModelArgs(
        max_seq_len=max_seq_len,
        vocab_size=int(config["vocab_size"]),
        dim=int(config["hidden_size"]),
        inter_dim=int(config["intermediate_size"]),
        moe_inter_dim=int(config["moe_intermediate_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_dense_layers=int(config.get("first_k_dense_replace", 0)),
        n_heads=int(config["num_attention_heads"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        moe_args=moe_args,
        n_expert_groups=n_group,
        n_limited_groups=int(config.get("topk_group") or 1) if n_group > 1 else 1,
        q_lora_rank=int(q_lora_rank) if q_lora_rank else 0,
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        **_rope(config, max_seq_len),
    )


def _check_supported(config: dict[str, Any]) -> None:
    problems = []
    if config.get("model_type") != "deepseek_v3":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'deepseek_v3' (DeepseekV3ForCausalLM)")
    if config.get("attention_bias"):
        problems.append("attention_bias=true: our MLA has no biases")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: our SwiGLU uses silu")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings=true: DeepSeek-V3 has its own lm_head")
    if config.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={config['moe_layer_freq']}: every block after the dense ones is an MoE")
    if config.get("rope_interleave", True) is not True:
        problems.append("rope_interleave=false: our RoPE rotates interleaved pairs, as DeepSeek's checkpoints do")
    if config.get("topk_method", "noaux_tc") != "noaux_tc" or config.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append("topk_method / scoring_func other than 'noaux_tc' / 'sigmoid' (HF's DeepseekV3 router)")
    if int(config.get("n_shared_experts", 1)) < 1:
        problems.append("n_shared_experts=0: HF's DeepseekV3 builds an empty shared MLP, which ours cannot")
    keys = [
        *("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads"),
        *("n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
        *("v_head_dim", "vocab_size"),
    ]
    for key in keys:
        if key not in config:
            problems.append(f"{key} is missing")
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))


def _rope(config: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    """Our rope fields from transformers 4's `rope_theta` + `rope_scaling` or 5's `rope_parameters`: plain RoPE, or
    YaRN as DeepSeek computes it (HF's rotary attention_factor 1, i.e. mscale == mscale_all_dim)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":  # no extension: YaRN off whatever the sequence length
        return {"rope_theta": theta, "rope_factor": 1.0, "original_seq_len": max_seq_len}
    if kind != "yarn":
        raise ValueError(f"unsupported Hugging Face config: rope type {kind!r}; our model implements 'yarn' only")
    problems = []
    original = params.get("original_max_position_embeddings")
    if original is None:
        problems.append("rope_scaling.original_max_position_embeddings is missing")
    factor = params.get("factor") or (max_seq_len / original if original else 1.0)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not mscale or mscale != mscale_all_dim:
        problems.append(
            f"rope_scaling mscale({mscale}) != mscale_all_dim({mscale_all_dim}): HF then scales the rotary channels "
            f"by their ratio, which DeepSeek's YaRN (and ours) does not"
        )
    if params.get("attention_factor") not in (None, 1, 1.0):
        problems.append(f"rope_scaling.attention_factor={params['attention_factor']}: ours is 1")
    if params.get("truncate", True) is not True:
        problems.append("rope_scaling.truncate=false: DeepSeek's YaRN rounds the correction range")
    if original is not None and max_seq_len <= int(original):
        problems.append(
            f"max_position_embeddings({max_seq_len}) <= original_max_position_embeddings({original}): our model (as "
            f"torchtitan) applies YaRN only beyond the original context, HF always"
        )
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))
    return {
        "rope_theta": theta,
        "rope_factor": float(factor),
        "original_seq_len": int(original),  # type: ignore[arg-type]
        "beta_fast": params.get("beta_fast") or 32,
        "beta_slow": params.get("beta_slow") or 1,
        "mscale": float(mscale_all_dim),  # type: ignore[arg-type]
    }


def closest_flavor(args: DeepSeekV3ModelArgs) -> str:
    """The deepseek_v3 flavor whose weights and numerics `args` has, up to vocab_size and max_seq_len (the trainer
    sets both), or "custom"."""
    for name, flavor in deepseek_v3_configs.items():
        if _architecture(flavor) == _architecture(args):
            return name
    return "custom"


def _architecture(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """What the weights and the forward depend on: every field but the sequence and batch bounds and the vocabulary
    (and how the experts are computed: grouped GEMM or a loop)."""
    raw = model_args_to_json(args)
    for key in ("max_batch_size", "max_seq_len", "vocab_size"):
        raw.pop(key)
    for key in ("use_grouped_mm", "_debug_force_load_balance"):
        raw["moe_args"].pop(key)
    return raw


def model_args_to_json(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """`args` as the JSON a checkpoint's metadata stores ("model_args"; moe_args as a nested dict)."""
    return dataclasses.asdict(args)


def model_args_from_json(raw: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """The inverse of `model_args_to_json`; TypeError naming unknown fields."""
    fields = {f.name for f in dataclasses.fields(DeepSeekV3ModelArgs)}
    moe_fields = {f.name for f in dataclasses.fields(MoEArgs)}
    unknown = sorted(set(raw) - fields) + [f"moe_args.{k}" for k in sorted(set(raw.get("moe_args") or {}) - moe_fields)]
    if unknown:
        raise TypeError(f"model_args has unknown fields {unknown}; this meshtrain knows {sorted(fields)}")
    moe = raw.get("moe_args")
    return DeepSeekV3ModelArgs(**{**raw, **({"moe_args": MoEArgs(**moe)} if moe is not None else {})})


# ---------------------------------------------------------------------------------- adapter
class DeepSeekV3HFAdapter:
    """DeepSeek-V3 <-> `DeepseekV3ForCausalLM` as checkpoint.hf_adapter_protocol.HFAdapter: this module's functions.

    The methods look the functions up when called (patching a function patches the adapter too)."""

    name = "deepseek_v3"
    hf_architecture = "DeepseekV3ForCausalLM"
    flavors = deepseek_v3_configs
    output_fqn = "output.weight"
    embedding_fqn = "tok_embeddings.weight"
    ignored_hf_suffixes = HF_IGNORED_SUFFIXES
    hf_config_ambiguous_args: frozenset[str] = frozenset()

    def to_hf_name(self, fqn: str) -> str:
        return to_hf_name(fqn)

    def from_hf_name(self, name: str) -> str:
        return from_hf_name(name)

    def stacked_hf_names(self, fqn: str, args: DeepSeekV3ModelArgs) -> list[str] | None:
        return stacked_hf_names(fqn, args)

    def not_in_hf(self, fqn: str, args: DeepSeekV3ModelArgs) -> bool:
        return False  # the routing bias is HF's e_score_correction_bias

    def layer_of(self, fqn: str) -> int | None:
        return layer_of(fqn)

    def to_hf_tensor(self, fqn: str, w: torch.Tensor, args: DeepSeekV3ModelArgs) -> torch.Tensor:
        return w  # the layouts agree (module docstring)

    def from_hf_tensor(self, fqn: str, w: torch.Tensor, args: DeepSeekV3ModelArgs) -> torch.Tensor:
        return w

    def rotary_head_dim(self, fqn: str, args: DeepSeekV3ModelArgs) -> int | None:
        return None  # no tensor is permuted

    def permute_from_hf(self, w: torch.Tensor, n_heads: int) -> torch.Tensor:
        return w

    def hf_config(self, args: DeepSeekV3ModelArgs, *, dtype: str, tie_word_embeddings: bool) -> dict[str, Any]:
        return hf_config(args, dtype=dtype, tie_word_embeddings=tie_word_embeddings)

    def args_from_hf_config(self, config: dict[str, Any]) -> DeepSeekV3ModelArgs:
        return args_from_hf_config(config)

    def closest_flavor(self, args: DeepSeekV3ModelArgs) -> str:
        return closest_flavor(args)

    def model_args_to_json(self, args: DeepSeekV3ModelArgs) -> dict[str, Any]:
        return model_args_to_json(args)

    def model_args_from_json(self, raw: dict[str, Any]) -> DeepSeekV3ModelArgs:
        return model_args_from_json(raw)

    def parameter_shapes(self, args: DeepSeekV3ModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(args, output=output)


DEEPSEEK_V3_HF_ADAPTER = DeepSeekV3HFAdapter()
