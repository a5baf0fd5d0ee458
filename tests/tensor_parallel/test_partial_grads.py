"""reduce_partial_grads: under sequence parallelism the norms' weight gradients are Partial; one coalesced
all-reduce per mesh dim makes them Replicate with the same values, after which clipping and AdamW issue no
collective (left Partial, each of them all-reduces every such gradient again)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tests.world import run_world


def _tp_step(reduce_first: bool) -> dict:
    from models.llama3 import llama3_configs
    from models.llama3.model import Transformer
    from models.llama3.parallelize import apply_tp
    from parallelisms.dtensor import DTensor, Partial, init_device_mesh
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.tensor_parallel.partial_grads import reduce_partial_grads

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(llama3_configs["debugmodel"], vocab_size=256, max_seq_len=32, n_layers=2))
    apply_tp(model, mesh, loss_parallel=False)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    partial = [n for n, p in model.named_parameters() if any(isinstance(q, Partial) for q in p.grad.placements)]
    before = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    issued = reduce_partial_grads(params) if reduce_first else 0
    after = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}  # clipping scales in place
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    with CommDebugMode() as comm:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"partial": partial, "issued": issued, "equal": all(torch.equal(before[n], after[n]) for n in before),
            "step_collectives": comm.get_total_counts(), "weights": weights}  # fmt: skip


def test_partial_gradients_reduced_once_then_the_step_is_local() -> None:
    plain, reduced = run_world(_tp_step, 2, False)[0], run_world(_tp_step, 2, True)[0]
    assert plain["partial"] and all("norm" in n for n in plain["partial"]), plain["partial"]
    assert reduced["issued"] == 1 and reduced["equal"]
    assert reduced["step_collectives"] == 1  # clipping's one all-reduce of the sharded gradients' norm
    assert plain["step_collectives"] > 2 * len(plain["partial"]), plain["step_collectives"]
    for name, w in plain["weights"].items():
        torch.testing.assert_close(reduced["weights"][name], w, rtol=1e-6, atol=1e-7, msg=name)
