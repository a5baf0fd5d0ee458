"""The arguments of a mixture-of-experts layer (torch-free: the pre-flight reads them from the flavors).

Field names and defaults are torchtitan v0.2's `MoEArgs`, so flavors and configs port; `num_expert_groups` /
`num_limited_groups` are DeepSeek's node-limited routing (torchtitan's HEAD names; its v0.2 keeps them on the
DeepSeek-V3 args as `n_expert_groups` / `n_limited_groups`, which that family's args hand down here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass(kw_only=True)
class MoEArgs:
    """A token-choice top-k mixture of SwiGLU experts (models/common/moe.py: MoE)."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_shared_experts: int = 1
    """Experts every token passes through, as one SwiGLU `num_shared_experts` times as wide; 0 for none."""
    score_func: ScoreFunc = "sigmoid"
    """How router logits become scores: "softmax" over the experts, or an independent "sigmoid" per expert."""
    route_norm: bool = False
    """Divide each token's top-k scores by their sum."""
    route_scale: float = 1.0
    """Multiply the (normalized) top-k scores by this."""
    score_before_experts: bool = True
    """Scale each routed token by its score before the experts (True) or their outputs after them (False)."""
    top_k: int = 1
    """Experts each token is routed to."""
    use_grouped_mm: bool = True
    """Routed experts as one grouped GEMM over all experts (True) or a loop over the experts (the reference)."""
    load_balance_coeff: float | None = 1e-3
    """Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3): before each optimizer step, each
    expert's routing bias moves by this much towards the mean load; None turns balancing (and the bias) off."""
    num_expert_groups: int | None = None
    """Node-limited routing: experts in this many groups, of which each token may use `num_limited_groups`."""
    num_limited_groups: int | None = None
    """Groups a token's experts may come from (the groups whose two best scores sum highest)."""
    _debug_force_load_balance: bool = False
    """Route round-robin instead of by score, so every expert gets the same tokens (training.debug_moe_force_
    load_balance: for benchmarks that must not depend on what the router learned)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the field when the experts, groups or scores do not fit together."""
        if self.num_experts < 1 or self.num_shared_experts < 0:
            raise ValueError(
                f"moe_args: num_experts({self.num_experts}) must be >= 1 and num_shared_experts"
                f"({self.num_shared_experts}) >= 0"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"moe_args.top_k({self.top_k}) must be between 1 and num_experts({self.num_experts}): a token is "
                f"routed to top_k distinct experts"
            )
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_args.score_func={self.score_func!r}: expected 'softmax' or 'sigmoid'")
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0:
            raise ValueError(
                f"moe_args.load_balance_coeff({self.load_balance_coeff}) must be > 0, or None to turn balancing off"
            )
        if (self.num_expert_groups is None) != (self.num_limited_groups is None):
            raise ValueError("moe_args: set both num_expert_groups and num_limited_groups, or neither")
        if self.num_expert_groups is not None and self.num_limited_groups is not None:
            groups, limited = self.num_expert_groups, self.num_limited_groups
            if groups < 1 or self.num_experts % groups or self.num_experts // groups < 2:
                raise ValueError(
                    f"moe_args.num_expert_groups({groups}) must divide num_experts({self.num_experts}) into groups "
                    f"of at least 2 (a group is scored by its two best experts)"
                )
            if not 1 <= limited <= groups or limited * (self.num_experts // groups) < self.top_k:
                raise ValueError(
                    f"moe_args.num_limited_groups({limited}) must be between 1 and num_expert_groups({groups}) and "
                    f"hold top_k({self.top_k}) experts ({self.num_experts // groups} per group)"
                )

    @property
    def active_fraction(self) -> float:
        """The share of the routed experts' parameters one token uses: top_k / num_experts."""
        return self.top_k / self.num_experts
