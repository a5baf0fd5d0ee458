"""Qwen3 model arguments and the named flavors, dense and MoE (torch-free: the pre-flight reads them).

Field names, defaults and flavors are torchtitan v0.2's `Qwen3ModelArgs` / `qwen3_args`, so configs port. Two
things differ from Llama 3's args: `head_dim` is free of `dim` (128 at every Qwen3 width), and the FFN width is
given outright (`hidden_dim`, HF's `intermediate_size`) instead of being derived from `dim`. With `moe_enabled`,
every block's FFN is a mixture of `moe_args.num_experts` SwiGLU experts `moe_inter_dim` wide
(models/common/moe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from models.common.mask_types import check_mask_type
from models.common.moe_args import MoEArgs


@dataclass(kw_only=True)
class Qwen3ModelArgs:
    """Shape and numerics of a Qwen3 decoder (Yang et al. 2025, "Qwen3 Technical Report")."""

    dim: int = 1024
    """Model (residual stream) width."""
    n_layers: int = 28
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads."""
    n_kv_heads: int = 8
    """Key/value heads for grouped-query attention (n_heads must be a multiple)."""
    vocab_size: int = 151936
    """Vocabulary size (Qwen's tokenizer by default; the trainer sets it from its tokenizer)."""
    head_dim: int = 128
    """Width of one attention head, independent of dim (Qwen3: 128 throughout)."""
    hidden_dim: int = 3072
    """The dense SwiGLU's hidden width (HF's intermediate_size); unused by MoE blocks."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (the block norms and the QK norms)."""
    rope_theta: float = 1000000
    """RoPE base frequency."""
    qk_norm: bool = True
    """RMS-normalize queries and keys per head before RoPE (Qwen3's change over Qwen2)."""
    max_seq_len: int = 4096
    """Longest sequence the precomputed rotary table covers (the trainer sets it to training.seq_len)."""
    depth_init: bool = True
    """Scale each block's output-projection init std by its depth (True) or by n_layers (False)."""
    use_flex_attn: bool = False
    """Block-causal attention through FlexAttention where torch runs it forward and backward (CUDA); elsewhere the
    per-document SDPA kernel. torchtitan's name."""
    attn_mask_type: str = "causal"
    """"causal", or "block_causal": attention stays inside the documents packed into a row, each ending at its EOS
    token (models/common/documents.py). torchtitan's name."""
    eos_id: int = 151645
    """The end-of-document token of block-causal masking (the trainer sets it from its tokenizer)."""
    enable_weight_tying: bool = False
    """The output projection is the token embedding's weight (Qwen3 0.6B, 1.7B, 4B)."""
    moe_enabled: bool = False
    """Every block's FFN is a mixture of experts (Qwen3-MoE) instead of a dense SwiGLU."""
    moe_inter_dim: int = 768
    """Hidden width of one routed expert (HF's moe_intermediate_size)."""
    moe_args: MoEArgs = field(default_factory=MoEArgs)
    """The router and experts of the MoE blocks (read only when moe_enabled)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the field and the fix when the args do not describe a buildable model."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}({getattr(self, name)}) must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads({self.n_heads}) must be divisible by n_kv_heads({self.n_kv_heads}): each key/value head "
                f"serves n_heads / n_kv_heads query heads; choose n_kv_heads among the divisors of n_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim({self.head_dim}) must be even: RoPE rotates channels in pairs")
        check_mask_type(self.attn_mask_type)
        if self.moe_enabled:
            if self.moe_inter_dim < 1:
                raise ValueError(f"moe_inter_dim({self.moe_inter_dim}) must be >= 1 when moe_enabled")
            self.moe_args.check()

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Qwen3ModelArgs:
        """The args of a Hugging Face Qwen3 / Qwen3-MoE `config.json` (models/qwen3/hf_adapter.py:
        args_from_hf_config); ValueError naming the key our model cannot express."""
        # imported here: hf_adapter imports torch, which the pre-flight's flavors must not
        from .hf_adapter import args_from_hf_config

        return args_from_hf_config(config)

    @property
    def tie_word_embeddings(self) -> bool:
        """Hugging Face's name for `enable_weight_tying` (what the Decoder frame and the conversion read)."""
        return self.enable_weight_tying

    @property
    def parameter_count(self) -> int:
        """The model's parameters, counted from its shapes (no torch needed: the pre-flight's memory floor); the
        MoE's routing bias is a buffer, not counted."""
        return sum(math.prod(shape) for fqn, shape in parameter_shapes(self).items() if not is_routing_bias(fqn))

    @property
    def active_parameter_count(self) -> int:
        """The parameters one token uses: the routed experts count top_k / num_experts of theirs (the "A3B" of
        30B-A3B); equal to `parameter_count` for a dense model."""
        if not self.moe_enabled:
            return self.parameter_count
        routed = sum(math.prod(s) for fqn, s in parameter_shapes(self).items() if ".moe.experts." in fqn)
        return self.parameter_count - routed + round(routed * self.moe_args.active_fraction)


def is_routing_bias(fqn: str) -> bool:
    """Whether `fqn` is an MoE's load-balancing routing bias (`layers.N.moe.expert_bias`): saved state of our
    model, which HF's Qwen3-MoE has no place for."""
    return fqn.endswith(".moe.expert_bias")


def _block_shapes(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
    """One block's parameters (names below `layers.N.`), in the order of HF's per-layer tensors."""
    q, kv, d = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim
    block: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (q, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, q),
    }
    if args.qk_norm:
        block["attention.q_norm.weight"] = (args.head_dim,)
        block["attention.k_norm.weight"] = (args.head_dim,)
    if args.moe_enabled:
        e, h = args.moe_args.num_experts, args.moe_inter_dim
        block["moe.router.gate.weight"] = (e, d)
        if args.moe_args.load_balance_coeff is not None:  # the buffer is saved (persistent) exactly then
            block["moe.expert_bias"] = (e,)
        block["moe.experts.w1"] = (e, h, d)
        block["moe.experts.w3"] = (e, h, d)
        block["moe.experts.w2"] = (e, d, h)
        if args.moe_args.num_shared_experts > 0:  # not in HF's Qwen3-MoE; our MoE allows them
            hs = h * args.moe_args.num_shared_experts
            block["moe.shared_experts.w1.weight"] = (hs, d)
            block["moe.shared_experts.w3.weight"] = (hs, d)
            block["moe.shared_experts.w2.weight"] = (d, hs)
    else:
        block["feed_forward.w1.weight"] = (args.hidden_dim, d)
        block["feed_forward.w3.weight"] = (args.hidden_dim, d)
        block["feed_forward.w2.weight"] = (d, args.hidden_dim)
    block["attention_norm.weight"] = (d,)
    block["ffn_norm.weight"] = (d,)
    return block


def parameter_shapes(args: Qwen3ModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Our FQN -> shape of every saved tensor of `Qwen3Model(args)`, in Hugging Face's file order (blocks in number
    order); without `output` when the output projection is tied to the embedding (by default when
    `args.enable_weight_tying`). Besides the parameters, that is the MoE's routing bias `moe.expert_bias` (E,) when
    load balancing is on (`moe_args.load_balance_coeff`): a persistent buffer, which a checkpoint holds and HF's
    format has no place for (the adapter's `not_in_hf`); the rotary table is derived, never saved."""
    output = not args.tie_word_embeddings if output is None else output
    block = _block_shapes(args)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes["norm.weight"] = (args.dim,)
    if output:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def _qwen3_moe_args(num_experts: int) -> MoEArgs:
    """Qwen3-MoE's router: softmax over the experts, top 8 renormalized, outputs scaled after the experts, no
    shared experts (torchtitan's values; load balancing at MoEArgs' default)."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=8,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
    )


# fmt: off
# every flavor keeps the defaults head_dim=128, qk_norm=True, norm_eps=1e-6, rope_theta=1e6, max_seq_len=4096 and
# vocab_size=151936 (torchtitan spells them out) unless it says otherwise
qwen3_configs: dict[str, Qwen3ModelArgs] = {
    "debugmodel": Qwen3ModelArgs(vocab_size=2048, dim=256, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=3072,
                                 enable_weight_tying=True),
    "0.6B": Qwen3ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, enable_weight_tying=True),
    "1.7B": Qwen3ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, enable_weight_tying=True),
    "4B": Qwen3ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, enable_weight_tying=True),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    # Qwen3-MoE
    "debugmodel_moe": Qwen3ModelArgs(vocab_size=2048, dim=256, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=3072,
                                     moe_enabled=True, moe_inter_dim=768, moe_args=_qwen3_moe_args(64)),
    "30B-A3B": Qwen3ModelArgs(max_seq_len=262144, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144,
                              moe_enabled=True, moe_inter_dim=768, moe_args=_qwen3_moe_args(128)),
    "235B-A22B": Qwen3ModelArgs(rope_theta=5000000, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                                moe_enabled=True, moe_inter_dim=1536, moe_args=_qwen3_moe_args(128)),
}
# fmt: on
