"""The mixture-of-experts layer: a token-choice top-k router, routed SwiGLU experts as one grouped GEMM,
shared experts, and the state of auxiliary-loss-free load balancing (imports only torch).

One MoE layer's forward over N tokens of width D, with E experts and top-k routing:

    router        scores (N, E) = score_func(gate(x)); each token picks k experts by score (+ expert_bias)
    permutation   the N k (token, expert) pairs sorted by expert: a stable argsort, no loop over experts
    experts       one grouped GEMM per weight over the sorted tokens, expert e's rows multiplying w[e]
    combine       outputs scaled by their scores and summed back onto their tokens (index_add)
    shared        + a dense SwiGLU of every token (DeepSeek's shared experts), if any

Names and semantics are torchtitan v0.2's (moe.router.gate, moe.experts.w1/w2/w3, moe.shared_experts.*,
moe.expert_bias), so state dicts port. Parallelism is applied from outside: under tensor parallelism the
experts' weights arrive as DTensors sharded on their hidden dim, which `GroupedExperts` computes on locally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .feed_forward import FeedForward
from .grouped_mm import grouped_mm
from .moe_args import MoEArgs


class TokenChoiceTopKRouter(nn.Module):
    """Each token's top_k experts by score: (N, D) -> scores (N, k) fp32 and expert indices (N, k).

    `expert_bias` (load balancing) shifts which experts are chosen, never the scores the outputs are scaled by.
    With node-limited routing (DeepSeek-V3), experts come in `num_expert_groups` groups, a group is scored by the
    sum of its two best (biased) scores, and a token chooses only among the `num_limited_groups` best groups.
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.num_expert_groups = args.num_expert_groups
        self.num_limited_groups = args.num_limited_groups
        self.force_load_balance = args._debug_force_load_balance

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()  # scores in fp32 whatever the compute dtype (as torchtitan)
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)  # (N, E)
        if self.force_load_balance:
            selected = torch.arange(scores.shape[0] * self.top_k, device=x.device).view(-1, self.top_k)
            selected = selected % self.num_experts
        else:
            choice = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                choice = self._limit_to_groups(choice)
            selected = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        top_scores = scores.gather(-1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores * self.route_scale, selected

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with every expert outside each token's `num_limited_groups` best groups at -inf."""
        assert self.num_expert_groups is not None and self.num_limited_groups is not None
        grouped = choice.unflatten(-1, (self.num_expert_groups, -1))  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        kept = group_scores.topk(self.num_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, kept, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(-2)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight's local shard under tensor parallelism (a DTensor's `to_local()`), else the weight: the routed
    token counts vary per step, which a grouped GEMM takes as offsets and a DTensor op rule cannot."""
    # the type's attribute: dynamo answers that for traced tensors too (a DTensor's, not plain Tensor's)
    return w.to_local() if hasattr(type(w), "to_local") else w  # type: ignore[attr-defined]


def grouped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert: the first counts[0] rows of `x` (M, D) go through expert 0's
    w1, w3 (E, H, D) and w2 (E, D, H), the next counts[1] through expert 1's, ...; three grouped GEMMs in all."""
    offsets = counts.cumsum(0, dtype=torch.int32)
    h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offsets))
    h = h * grouped_mm(x, w3.transpose(-2, -1), offsets)
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


def looped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` as a Python loop over the experts (the reference, and `use_grouped_mm = false`)."""
    outs = [
        (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T for e, rows in enumerate(torch.split(x, counts.tolist()))
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts held as stacked weights: w1, w3 (E, H, D) and w2 (E, D, H)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm

    def init_weights(self, init_std: float) -> None:
        """w1 ~ N(0, 0.02), w2 and w3 ~ N(0, init_std), cut at [-2, 2] (torchtitan's)."""
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(M, D) tokens sorted by expert, `counts` (E,) of them per expert -> (M, D)."""
        run = grouped_swiglu if self.use_grouped_mm else looped_swiglu
        return run(x, _local(self.w1), _local(self.w2), _local(self.w3), counts)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now: activation checkpointing then recomputes a forward,
    whose routing must not count twice. A compiled block traces its forward once (a recomputation is part of
    its backward graph), so there it is never in backward."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """A mixture-of-experts SwiGLU layer (B, T, D) -> (B, T, D); see the module docstring.

    Buffers: `expert_bias` (E,) fp32, persistent, the load-balancing routing bias (present when
    `load_balance_coeff` is set); `tokens_per_expert` (E,) fp32, not saved, the tokens routed to each expert since
    the last balancing update (trainer/moe_balance.py reads and clears it).
    """

    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, use_grouped_mm=args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * args.num_shared_experts) if args.num_shared_experts > 0 else None
        )
        self.score_before_experts = args.score_before_experts
        self.load_balance_coeff = args.load_balance_coeff
        bias = torch.zeros(args.num_experts) if args.load_balance_coeff is not None else None
        self.register_buffer("expert_bias", bias, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device or self.tokens_per_expert.device
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)  # (N, D)
        top_scores, selected = self.router(x, self.expert_bias)  # (N, k) each
        flat = selected.flatten()
        # a scatter, not bincount, whose output size depends on the data (the dry run traces on fake tensors)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )  # (E,)
        if not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        # the N k (token, expert) pairs sorted by expert; a stable sort keeps each expert's tokens in order
        order = flat.argsort(stable=True)  # (N k,)
        token_of = order // self.top_k
        scores = top_scores.flatten()[order].unsqueeze(-1)  # (N k, 1) fp32
        routed = x.index_select(0, token_of)  # (N k, D)
        if self.score_before_experts:
            routed = (routed.float() * scores).to(x.dtype)
        routed = self.experts(routed, counts)
        if not self.score_before_experts:
            routed = (routed.float() * scores).to(x.dtype)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        return out.index_add(0, token_of, routed).view(bs, seqlen, dim)
