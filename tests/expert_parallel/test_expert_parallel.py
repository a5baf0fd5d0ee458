"""Expert parallelism (parallelisms/expert_parallel/) against one process: the dispatch's index math, then an MoE
layer whose experts are sharded over 2 and 4 gloo ranks, each rank routing its own tokens. Outputs, input
gradients and every parameter gradient equal the one-process layer's on the whole batch; the collectives are the
all-to-alls and nothing else (CommDebugMode), with the bytes of the routed rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.common.moe import MoE
from models.common.moe_args import MoEArgs
from parallelisms.expert_parallel.dispatch import expert_major_order, token_slice
from tests.world import run_world

DIM, HIDDEN, BATCH, SEQ = 16, 8, 4, 6


def test_expert_major_order_regroups_source_major_rows() -> None:
    # 2 sources x 3 local experts; rows numbered in arrival (source-major) order
    received = torch.tensor([[2, 0, 1], [1, 3, 0]])
    order = expert_major_order(received, 7)
    # source 0: e0 rows 0,1  e2 row 2; source 1: e0 row 3  e1 rows 4,5,6
    assert order.tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_token_slice_cuts_the_rows_sorted_by_expert() -> None:
    counts = torch.tensor([3, 0, 4, 2])  # 9 rows: expert 0 rows 0-2, expert 2 rows 3-6, expert 3 rows 7-8
    assert [(lo, hi, c.tolist()) for lo, hi, c in (token_slice(counts, i, 2, 9) for i in range(2))] == [
        (0, 4, [3, 0, 1, 0]),
        (4, 9, [0, 0, 3, 2]),
    ]
    lo, hi, c = token_slice(counts, 2, 3, 9)  # uneven parts: 9 * 2 // 3 = 6 to 9
    assert (lo, hi, c.tolist()) == (6, 9, [0, 0, 1, 2])


def _moe(kw: dict) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEArgs(**({"num_experts": 8, "num_shared_experts": 1, "top_k": 3} | kw)), DIM, HIDDEN)
    moe.init_weights(0.02)
    for p in moe.parameters():  # larger weights: differences show above the rounding
        p.data.mul_(10)
    return moe


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(seed))


def _ep_layer(kw: dict) -> dict:
    from parallelisms.dtensor import DTensor, Shard, init_device_mesh
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.expert_parallel import ExpertParallel

    ep, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    moe = _moe(kw)
    ExpertParallel().apply(moe.experts, mesh)
    received: list[int] = []  # the rows this rank's experts computed (the dispatch's output)
    moe.experts.register_forward_hook(lambda mod, args, out: received.append(args[0].shape[0]))
    x = _batch(1).chunk(ep)[rank].clone().requires_grad_()  # this rank's sequences
    with CommDebugMode() as comm:
        out = moe(x)
        forward = dict(comm.get_comm_counts())
        out.backward(_batch(2).chunk(ep)[rank])
    grads = {}
    for name, p in moe.named_parameters():
        if isinstance(p.grad, DTensor):
            assert p.placements == (Shard(0),), (name, p.placements)  # whole experts, E / ep of them per rank
            grads[name] = p.grad.full_tensor()
        else:  # replicated: each rank's part of the gradient, summed
            dist.all_reduce(p.grad)
            grads[name] = p.grad
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": grads,
        "forward": {str(k): v for k, v in forward.items()},
        "total": {str(k): v for k, v in comm.get_comm_counts().items()},
        "bytes": {str(k): v for k, v in comm.get_comm_bytes().items()},
        "rows": int(moe.tokens_per_expert.sum()),
        "received": received[0],
        "local_experts": moe.experts.w1.to_local().shape[0],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "kw", [{"score_func": "softmax", "route_norm": True, "num_shared_experts": 0},
           {"score_func": "sigmoid", "score_before_experts": True, "num_expert_groups": 2, "num_limited_groups": 1}],
    ids=["qwen3_like", "deepseek_like"],
)  # fmt: skip
def test_expert_parallel_layer_equals_one_process(world: int, kw: dict) -> None:
    ref = _moe(kw)
    x = _batch(1).requires_grad_()
    out = ref(x)
    out.backward(_batch(2))
    results = run_world(_ep_layer, world, kw)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out"], out.detach().chunk(world)[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["x_grad"], x.grad.chunk(world)[rank], atol=1e-5, rtol=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
        assert r["local_experts"] == 8 // world
        # forward: the counts' all-to-all and the rows' there and back; backward: the rows' two; nothing else
        a2a = "c10d_functional.all_to_all_single"
        assert r["forward"] == {a2a: 3}, r["forward"]
        assert r["total"] == {a2a: 5}, r["total"]
        rows = r["rows"]  # this rank's routed (token, expert) pairs: BATCH / world x SEQ x top_k
        assert rows == BATCH // world * SEQ * 3
        # bytes handed to the all-to-alls: the counts (8 int64), the rows sent out and their outputs' gradients
        # (routed rows each), the outputs sent home and the rows' gradients (received rows each); fp32 x DIM
        assert r["bytes"][a2a] == 8 * 8 + 2 * (rows + r["received"]) * DIM * 4
    assert sum(r["received"] for r in results) == BATCH * SEQ * 3  # every pair computed once, somewhere
