"""DeepSeek-V3 model arguments and the named flavors (torch-free: the pre-flight reads them before torch).

Field names, defaults and flavors are torchtitan v0.2's `DeepSeekV3ModelArgs` / `deepseekv3_args`, so configs
port; the differences are listed on the class.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from models.common.mask_types import check_mask_type
from models.common.moe_args import MoEArgs


@dataclass(kw_only=True)
class DeepSeekV3ModelArgs:
    """Shape and numerics of a DeepSeek-V3 transformer: multi-head latent attention (MLA) and, after the first
    `n_dense_layers` blocks, a mixture of experts (DeepSeek-AI 2024, arXiv:2412.19437).

    Differences from torchtitan v0.2:
    - `n_expert_groups` / `n_limited_groups` > 1 route node-limited (torchtitan's TODO): they are handed to the MoE
      as `MoEArgs.num_expert_groups` / `num_limited_groups` (`moe_layer_args`).
    - `attn_mask_type` "block_causal" masks attention at document ends (models/common/documents.py);
      `use_flex_attn` runs it through FlexAttention where torch can (CUDA). torchtitan's flavors are kept.
    - YaRN applies, as in torchtitan, only when `max_seq_len > original_seq_len` (and `rope_factor > 1`): training
      at the original context or below uses plain RoPE and the plain softmax scale. Hugging Face's DeepseekV3 applies
      YaRN whenever its config has `rope_scaling` of type "yarn", whatever the sequence length, so our logits equal
      HF's for a YaRN config only when `max_seq_len > original_seq_len` (`from_hf_config` refuses otherwise).
    """

    max_batch_size: int = 8
    """Unused by training (torchtitan keeps it from the inference reference)."""
    max_seq_len: int = 4096 * 4
    """Longest sequence the precomputed rotary table covers (the trainer sets it to training.seq_len)."""
    vocab_size: int = 102400
    """Vocabulary size (the trainer sets it from its tokenizer)."""
    dim: int = 2048
    """Model (residual stream) width."""
    inter_dim: int = 10944
    """SwiGLU hidden width of the dense blocks."""
    moe_inter_dim: int = 1408
    """SwiGLU hidden width of each routed expert (shared experts: num_shared_experts times this)."""
    n_layers: int = 27
    """Number of transformer blocks."""
    n_dense_layers: int = 1
    """The first this many blocks have a dense SwiGLU instead of the MoE (HF: first_k_dense_replace)."""
    n_heads: int = 16
    """Attention heads."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon, of every norm (HF's DeepseekV3 uses 1e-6 for the two latent norms whatever its rms_norm_eps)."""
    moe_args: MoEArgs = field(default_factory=MoEArgs)
    """The MoE layers' arguments (models/common/moe_args.py)."""
    n_expert_groups: int = 1
    """Node-limited routing: the routed experts in this many groups; 1 for none (HF: n_group)."""
    n_limited_groups: int = 1
    """Groups each token's experts may come from (HF: topk_group)."""
    q_lora_rank: int = 0
    """Rank of the low-rank query projection (wq_a, q_norm, wq_b); 0 for a full-rank wq."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (wkv_a -> kv_norm -> wkv_b)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without rotary embedding."""
    qk_rope_head_dim: int = 64
    """Per-head query channels with rotary embedding; the key's are one head shared by all heads."""
    v_head_dim: int = 128
    """Per-head value channels."""
    use_flex_attn: bool = False
    """Block-causal attention through FlexAttention where torch runs it forward and backward (CUDA); elsewhere the
    per-document SDPA kernel. torchtitan's name."""
    attn_mask_type: str = "causal"
    """"causal", or "block_causal": attention stays inside the documents packed into a row, each ending at its EOS
    token (models/common/documents.py). torchtitan's name."""
    eos_id: int | None = None
    """The end-of-document token of block-causal masking (the trainer sets it from its tokenizer)."""
    original_seq_len: int = 4096
    """The context the model was pre-trained with; YaRN extends beyond it."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_factor: float = 40
    """YaRN's context extension factor."""
    beta_fast: int = 32
    """YaRN: rotary pairs turning more often than this over the original context are kept."""
    beta_slow: int = 1
    """YaRN: rotary pairs turning less often than this are interpolated by rope_factor."""
    mscale: float = 1.0
    """YaRN: the softmax scale is multiplied by (0.1 * mscale * ln(rope_factor) + 1)^2 (HF: mscale_all_dim)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the field and the fix when the arguments do not fit together."""
        check_mask_type(self.attn_mask_type)
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers({self.n_dense_layers}) must be between 0 and n_layers({self.n_layers})")
        if self.q_lora_rank < 0 or self.kv_lora_rank < 1:
            raise ValueError(
                f"q_lora_rank({self.q_lora_rank}) must be >= 0 (0: a full-rank wq) and kv_lora_rank"
                f"({self.kv_lora_rank}) >= 1"
            )
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.qk_nope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim({self.qk_rope_head_dim}) must be even and >= 2 (RoPE rotates channel pairs) and "
                f"qk_nope_head_dim({self.qk_nope_head_dim}) even"
            )
        if self.qk_nope_head_dim < 0 or self.v_head_dim < 1:
            raise ValueError(
                f"qk_nope_head_dim({self.qk_nope_head_dim}) must be >= 0, v_head_dim({self.v_head_dim}) >= 1"
            )
        if self.rope_factor < 1 or self.original_seq_len < 1:
            raise ValueError(
                f"rope_factor({self.rope_factor}) must be >= 1 (YaRN extends the context; 1 is plain RoPE) and "
                f"original_seq_len({self.original_seq_len}) >= 1"
            )
        if self.n_expert_groups < 1 or self.n_limited_groups < 1:
            raise ValueError(
                f"n_expert_groups({self.n_expert_groups}) and n_limited_groups({self.n_limited_groups}) must be >= 1 "
                f"(1 and 1: no node-limited routing)"
            )
        if self.n_expert_groups == 1 and self.n_limited_groups != 1:
            raise ValueError(
                f"n_limited_groups({self.n_limited_groups}) needs n_expert_groups > 1; set n_limited_groups=1 for no "
                f"node-limited routing"
            )
        _ = self.moe_layer_args  # MoEArgs checks the groups against its experts (ValueError naming the fields)

    @property
    def moe_layer_args(self) -> MoEArgs:
        """The MoE layers' arguments: `moe_args` with node-limited routing from n_expert_groups / n_limited_groups."""
        if self.n_expert_groups == 1:
            return self.moe_args
        return dataclasses.replace(
            self.moe_args, num_expert_groups=self.n_expert_groups, num_limited_groups=self.n_limited_groups
        )

    @property
    def tie_word_embeddings(self) -> bool:
        """DeepSeek-V3 never ties the output projection to the embedding (the frame and the HF conversion ask)."""
        return False

    @property
    def qk_head_dim(self) -> int:
        """Query/key channels per head: the non-rotary ones, then the rotary ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        """Whether the rotary table and the softmax scale use YaRN: torchtitan's condition, max_seq_len beyond the
        original context (and a factor that extends it)."""
        return self.max_seq_len > self.original_seq_len and self.rope_factor > 1

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DeepSeekV3ModelArgs:
        """The args of a Hugging Face DeepSeek-V3 `config.json` (models/deepseek_v3/hf_adapter.py:
        args_from_hf_config); ValueError naming each key our model cannot express."""
        # imported here: hf_adapter imports torch, which the pre-flight's flavors must not
        from .hf_adapter import args_from_hf_config

        return args_from_hf_config(config)

    @property
    def parameter_count(self) -> int:
        """The model's parameters, counted from its shapes (no torch; the load-balancing bias is a buffer)."""
        return sum(math.prod(s) for k, s in parameter_shapes(self).items() if not k.endswith("moe.expert_bias"))

    @property
    def active_parameter_count(self) -> int:
        """The parameters one token uses: the routed experts counted top_k / num_experts (the shared ones whole)."""
        routed = sum(math.prod(s) for k, s in parameter_shapes(self).items() if ".moe.experts." in k)
        return self.parameter_count - routed + round(routed * self.moe_args.active_fraction)


def parameter_shapes(args: DeepSeekV3ModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Our FQN -> shape of every state-dict tensor of `DeepSeekV3Model(args)` (parameters and the load-balancing
    `moe.expert_bias` buffer, which HF stores as e_score_correction_bias), in Hugging Face's file order (blocks in
    number order, the routed experts stacked). `output=False` leaves out the output projection."""
    output = True if output is None else output
    d, heads, moe = args.dim, args.n_heads, args.moe_args
    query: dict[str, tuple[int, ...]]
    if args.q_lora_rank == 0:
        query = {"attention.wq.weight": (heads * args.qk_head_dim, d)}
    else:
        query = {
            "attention.wq_a.weight": (args.q_lora_rank, d),
            "attention.q_norm.weight": (args.q_lora_rank,),
            "attention.wq_b.weight": (heads * args.qk_head_dim, args.q_lora_rank),
        }
    attention = {
        **query,
        "attention.wkv_a.weight": (args.kv_lora_rank + args.qk_rope_head_dim, d),
        "attention.kv_norm.weight": (args.kv_lora_rank,),
        "attention.wkv_b.weight": (heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
        "attention.wo.weight": (d, heads * args.v_head_dim),
    }
    dense = {
        "feed_forward.w1.weight": (args.inter_dim, d),
        "feed_forward.w3.weight": (args.inter_dim, d),
        "feed_forward.w2.weight": (d, args.inter_dim),
    }
    experts, hidden, shared = moe.num_experts, args.moe_inter_dim, args.moe_inter_dim * moe.num_shared_experts
    sparse: dict[str, tuple[int, ...]] = {
        "moe.experts.w1": (experts, hidden, d),
        "moe.experts.w3": (experts, hidden, d),
        "moe.experts.w2": (experts, d, hidden),
        "moe.router.gate.weight": (experts, d),
    }
    if moe.load_balance_coeff is not None:
        sparse["moe.expert_bias"] = (experts,)
    if shared:
        sparse.update(
            {
                "moe.shared_experts.w1.weight": (shared, d),
                "moe.shared_experts.w3.weight": (shared, d),
                "moe.shared_experts.w2.weight": (d, shared),
            }
        )
    norms = {"attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        block = {**attention, **(dense if i < args.n_dense_layers else sparse), **norms}
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes["norm.weight"] = (d,)
    if output:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


# torchtitan v0.2's flavors. Its 16B, 236B and 671B train with use_flex_attn=True, attn_mask_type="block_causal";
# here they stay causal (the defaults, which the dry run's published comparisons assume): set the two keys to match.
# fmt: off
deepseek_v3_configs: dict[str, DeepSeekV3ModelArgs] = {
    "debugmodel": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=6, n_dense_layers=1, n_heads=16,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=2, top_k=3, score_func="softmax", route_norm=False,
                         score_before_experts=False),
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mscale=0.70,
    ),
    "16B": DeepSeekV3ModelArgs(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1, n_heads=16,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                         score_before_experts=False),
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mscale=0.70,
    ),
    "236B": DeepSeekV3ModelArgs(
        vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60, n_dense_layers=1, n_heads=128,
        moe_args=MoEArgs(num_experts=160, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                         route_scale=16.0, score_before_experts=False),
        n_expert_groups=8, n_limited_groups=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3, n_heads=128,
        moe_args=MoEArgs(num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
                         route_scale=2.5, score_before_experts=False),
        n_expert_groups=8, n_limited_groups=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}
# fmt: on
