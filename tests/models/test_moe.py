"""The MoE layer (models/common/moe.py) against direct references: the grouped GEMM against a loop over the
experts, the layer against a per-token sum over its chosen experts, the router's options (softmax / sigmoid,
route_norm, route_scale, the balancing bias, node-limited groups, forced balance); routing counted once under
activation checkpointing; the balancing update's rule and its sum over ranks; and tensor parallelism of the layer
(router replicated, experts sharded on their hidden dim) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.common.moe import MoE, grouped_swiglu, looped_swiglu
from models.common.moe_args import MoEArgs
from tests.world import run_world

DIM, HIDDEN = 16, 8


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(**({"num_experts": 8, "num_shared_experts": 1, "top_k": 3} | kw))
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(0.02)
    for p in moe.parameters():  # larger weights: differences show above the rounding
        p.data.mul_(10)
    return moe


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_grouped_gemm_equals_a_loop_over_experts_forward_and_backward() -> None:
    counts = torch.tensor([5, 0, 3, 9, 1, 0, 2, 4])  # empty experts included
    x, w1, w2, w3 = _x(24, DIM), _x(8, HIDDEN, DIM, seed=2), _x(8, DIM, HIDDEN, seed=3), _x(8, HIDDEN, DIM, seed=4)
    grads = []
    for run in (grouped_swiglu, looped_swiglu):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = run(*leaves, counts)
        out.backward(_x(*out.shape, seed=5))
        grads.append((out, *(t.grad for t in leaves)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads[0][2][1].abs().sum() == 0  # an expert without tokens gets no gradient


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token: its shared experts plus the sum over its chosen experts of score x expert(token)."""
    flat = x.reshape(-1, DIM)
    scores, chosen = moe.router(flat, moe.expert_bias)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(flat.shape[0]):
        out = moe.shared_experts(flat[t]) if moe.shared_experts is not None else torch.zeros(DIM)
        for s, e in zip(scores[t], chosen[t]):
            inp = flat[t] * s if moe.score_before_experts else flat[t]
            y = (F.silu(w1[e] @ inp) * (w3[e] @ inp)) @ w2[e].T
            out = out + (y if moe.score_before_experts else y * s)
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize(
    "kw",
    [
        {"score_func": "softmax", "score_before_experts": False, "route_norm": True},
        {"score_func": "sigmoid", "route_scale": 2.5, "num_shared_experts": 2},
        {"score_func": "sigmoid", "num_expert_groups": 4, "num_limited_groups": 2, "route_norm": True},
        {"score_func": "softmax", "num_shared_experts": 0, "top_k": 1},
    ],
    ids=["softmax_after", "sigmoid_before_shared2", "groups", "top1_no_shared"],
)
def test_the_layer_is_the_per_token_sum_over_its_experts(kw: dict) -> None:
    moe, x = _moe(**kw), _x(2, 5, DIM)
    torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


def test_the_bias_changes_the_choice_not_the_scores() -> None:
    moe, x = _moe(score_func="sigmoid"), _x(10, DIM)
    scores, chosen = moe.router(x)
    bias = torch.zeros(8)
    bias[0] = 100.0  # expert 0 is chosen by every token, with its own unbiased score
    scores_b, chosen_b = moe.router(x, bias)
    assert (chosen_b == 0).any(dim=1).all()
    full = torch.sigmoid(moe.router.gate(x))
    torch.testing.assert_close(scores_b, full.gather(1, chosen_b))


def test_node_limited_routing_chooses_within_the_best_groups() -> None:
    moe, x = _moe(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2), _x(50, DIM)
    scores = torch.sigmoid(moe.router.gate(x))
    best = scores.view(50, 4, 2).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # (N, 2) groups
    _, chosen = moe.router(x)
    assert all(set((chosen[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(50))


def test_route_norm_and_scale() -> None:
    x = _x(7, DIM)
    scores, _ = _moe(score_func="sigmoid", route_norm=True, route_scale=2.5).router(x)
    torch.testing.assert_close(scores.sum(-1), torch.full((7,), 2.5))


def test_forced_balance_routes_round_robin() -> None:
    moe = _moe(_debug_force_load_balance=True)
    moe(_x(1, 16, DIM))
    assert moe.tokens_per_expert.tolist() == [6.0] * 8  # 16 tokens x 3 experts / 8


def test_routing_is_counted_once_under_activation_checkpointing() -> None:
    plain, ckpt = _moe(), _moe()
    x = _x(2, 6, DIM)
    plain(x).sum().backward()
    checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
    assert plain.tokens_per_expert.sum() == 36 and torch.equal(ckpt.tokens_per_expert, plain.tokens_per_expert)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"top_k": 9}, r"top_k\(9\) must be between 1 and num_experts\(8\)"),
        ({"num_expert_groups": 3, "num_limited_groups": 1}, r"num_expert_groups\(3\) must divide num_experts\(8\)"),
        ({"num_expert_groups": 4}, "set both num_expert_groups and num_limited_groups"),
        ({"load_balance_coeff": 0.0}, r"load_balance_coeff\(0.0\) must be > 0"),
        ({"score_func": "relu"}, "score_func='relu'"),
    ],
)
def test_bad_moe_args_name_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEArgs(**({"num_experts": 8, "top_k": 2} | kw))


class _Block(nn.Module):
    """What the balancer and the TP plan look for: a module holding `moe`."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def test_balancing_moves_the_bias_towards_the_mean_load() -> None:
    from trainer.moe_balance import ExpertBalancer

    block = _Block(_moe(load_balance_coeff=0.1))
    block.moe.tokens_per_expert.copy_(torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7]))
    balancer = ExpertBalancer([block], None)
    balancer.update()
    delta = 0.1 * torch.sign(torch.tensor(3.5) - torch.arange(8.0))
    torch.testing.assert_close(block.moe.expert_bias, delta - delta.mean())
    assert block.moe.tokens_per_expert.sum() == 0
    assert balancer.last is not None and balancer.last.max_tokens == {"moe": 7.0}


def _balance_on_ranks() -> list[float]:
    from trainer.moe_balance import ExpertBalancer

    block = _Block(_moe(load_balance_coeff=0.1))
    block.moe.tokens_per_expert.copy_(torch.arange(8.0) * (dist.get_rank() + 1))
    from parallelisms.dtensor import init_device_mesh

    ExpertBalancer([block], init_device_mesh("cpu", (2,))).update()
    return block.moe.expert_bias.tolist()


def test_ranks_balance_on_their_summed_counts() -> None:
    from trainer.moe_balance import ExpertBalancer

    biases = run_world(_balance_on_ranks, 2)
    block = _Block(_moe(load_balance_coeff=0.1))
    block.moe.tokens_per_expert.copy_(torch.arange(8.0) * 3)  # 1x + 2x
    ExpertBalancer([block], None).update()
    assert biases[0] == biases[1] == block.moe.expert_bias.tolist()


def _tp_moe(kw: dict) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    from models.decoder_parallelize import apply_moe_tp
    from parallelisms.dtensor import DTensor, init_device_mesh

    tp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    block = _Block(_moe(**kw))
    apply_moe_tp(block, mesh)
    x = _x(2, 8, DIM).chunk(tp, dim=1)[rank].clone().requires_grad_()  # this rank's sequence shard
    out = block(x)
    out.backward(_x(2, 8, DIM, seed=9).chunk(tp, dim=1)[rank])
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in block.named_parameters()}
    return out.detach().flatten().tolist(), grads, x.grad


@pytest.mark.parametrize(
    "kw", [{"score_func": "softmax", "score_before_experts": False, "route_norm": True, "num_shared_experts": 0},
           {"score_func": "sigmoid", "num_shared_experts": 2, "num_expert_groups": 2, "num_limited_groups": 1}],
    ids=["qwen3_like", "deepseek_like"],
)  # fmt: skip
def test_tensor_parallel_moe_equals_one_process(kw: dict) -> None:
    ref = _Block(_moe(**kw))
    x = _x(2, 8, DIM).requires_grad_()
    out = ref(x)
    out.backward(_x(2, 8, DIM, seed=9))
    results = run_world(_tp_moe, 2, kw)
    for rank, (local_out, grads, x_grad) in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(local_out), out.detach().chunk(2, dim=1)[rank].flatten(), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(x_grad, x.grad.chunk(2, dim=1)[rank], atol=1e-5, rtol=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def _recomputed_in_backward(forced: tuple[str, ...]) -> dict[str, int]:
    """Op-level SAC of a block holding an MoE: how many router matmuls and grouped GEMMs the backward recomputes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallelisms.activation_checkpoint import apply_ac

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Block(_moe(num_shared_experts=0))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](x)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = {"router_mm": 0, "grouped_mm": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default and tuple(args[1].shape) == (DIM, 8):
                self.seen["router_mm"] += 1
            if func is torch.ops.aten._grouped_mm.default:
                self.seen["grouped_mm"] += 1
            return func(*args, **(kwargs or {}))

    model = apply_ac(Blocks(), "selective", selective_option="op", force_recompute_mm_fqns=forced)
    out = model(_x(2, 5, DIM).requires_grad_())
    with Count() as count:
        out.sum().backward()
    return count.seen


def test_op_level_sac_counts_grouped_gemms_as_matmuls_and_recomputes_the_router() -> None:
    forced, unforced = _recomputed_in_backward(("moe.router.gate",)), _recomputed_in_backward(())
    # forward: the router's mm (x @ gate.T), then w1, w3, w2 as grouped GEMMs; the backward itself runs 6 grouped
    # GEMMs (2 per weight) and no mm by gate.T. Forced, the router's mm is recomputed and skips its turn: the
    # grouped GEMMs alternate saved, recomputed (w3), saved
    assert forced == {"router_mm": 1, "grouped_mm": 6 + 1}, forced
    # unforced, the router's mm takes the first turn (saved): w1 recomputed, w3 saved, w2 recomputed
    assert unforced == {"router_mm": 0, "grouped_mm": 6 + 2}, unforced
