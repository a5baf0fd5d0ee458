"""Where an expert-parallel training step goes, and the bytes its all-to-alls move against the least they could.

    python bench/ep_step.py --family deepseek_v3 --flavor debugmodel [--ep 2 --seq 256 --batch 2 --steps 4]

Runs the flavor (vocabulary 2048, as torchtitan_cpu.sh's tokenizer) on `--ep` gloo ranks of one thread each under
FSDP(ep) x EP(ep) (torchtitan_cpu.sh's `ep2` layout), fp32, fused AdamW, random tokens. Reports, from rank 0:
- step_s: the median step over `--steps` steps after two warm-up steps;
- share: one profiled step's wall time by category: the EP all-to-alls (`_c10d_functional.all_to_all_single` and
  their waits), FSDP's collectives (all-gathers, reduce-scatters), the grouped GEMM, and the rest;
- bytes: what one step hands the all-to-alls on this rank (CommDebugMode), the part that crosses to other ranks
  (rows of remote experts, each way, forward and backward), and two lower bounds: every (token, remote expert) pair
  there and back in both passes, and every (token, remote rank) pair once (a dispatch that sends a token once per
  rank, whatever number of that rank's experts it chose).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

A2A = ("_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor")
FSDP = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::alltoall_base_", "c10d::allreduce_")


def _rank(family: str, flavor: str, ep: int, seq: int, batch: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.profiler import profile

    from models.common.moe import MoE
    from models.registry import job_model_args, model_family
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=1, pp=1, world_size=dist.get_world_size(), ep=ep)
    mesh = dims.build_mesh("cpu")
    args = job_model_args(family, flavor, vocab_size=2048, max_seq_len=seq)
    parts = model_family(family).parts
    with torch.device("meta"):
        model = parts.model_class(args)
    parts.parallelize(model, dims, mesh, loss_parallel=False)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens, labels = (
        torch.randint(0, 2048, (batch, seq), generator=g),
        torch.randint(0, 2048, (batch, seq), generator=g),
    )

    def step() -> None:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    local = moes[0].num_experts // ep
    routed: list[dict[str, int]] = []

    def count_routes(mod: MoE, inputs: tuple, outputs: tuple) -> None:  # the router's (scores, chosen experts)
        ranks = outputs[1] // local  # (N, k): the rank each chosen expert lives on
        me = dist.get_rank() % ep
        pairs = int((ranks != me).sum())
        unique = sum(int((ranks == r).any(dim=1).sum()) for r in range(ep) if r != me)
        routed.append({"remote_pairs": pairs, "remote_token_ranks": unique})

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile() as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    seconds = {"ep_all_to_all": 0.0, "fsdp_collectives": 0.0, "grouped_gemm": 0.0}
    for e in prof.events():
        parent_names = set()
        p = e.cpu_parent
        while p is not None:
            parent_names.add(p.name)
            p = p.cpu_parent
        if e.name in A2A and not parent_names & set(A2A):
            seconds["ep_all_to_all"] += e.cpu_time_total / 1e6
        elif e.name in FSDP and not parent_names & set(FSDP + A2A):  # gloo's all-to-all under ours is ours
            seconds["fsdp_collectives"] += e.cpu_time_total / 1e6
        elif e.name == "aten::_grouped_mm" and "aten::_grouped_mm" not in parent_names:
            seconds["grouped_gemm"] += e.cpu_time_total / 1e6
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:8]
    top_ops = {a.key: round(a.self_cpu_time_total / 1e6 / wall, 3) for a in top}
    hooks = [m.router.register_forward_hook(count_routes) for m in moes]
    with CommDebugMode() as comm:
        step()
    for h in hooks:
        h.remove()
    handed = sum(v for k, v in comm.get_comm_bytes().items() if str(k) == "c10d_functional.all_to_all_single")
    row_bytes = args.dim * 4  # fp32 rows
    pairs = sum(r["remote_pairs"] for r in routed)
    return {
        "step_s": statistics.median(times),
        "profiled_step_s": wall,
        "share": {k: round(v / wall, 3) for k, v in seconds.items()},
        "top_ops_self_share": top_ops,
        "bytes": {
            "handed_to_all_to_all": handed,
            # the rows of remote experts leave and come back in the forward, and again as gradients in the backward
            "pairs_there_and_back": 4 * pairs * row_bytes,
            "token_per_remote_rank_there_and_back": 4 * sum(r["remote_token_ranks"] for r in routed) * row_bytes,
        },
        "moe_layers": len(moes),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="deepseek_v3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    from tests.world import run_world

    results = run_world(_rank, a.ep, a.family, a.flavor, a.ep, a.seq, a.batch, a.steps, timeout=1800)
    r = results[0]
    r["bytes"]["crossing_ranks"] = r["bytes"]["pairs_there_and_back"]  # what leaves the rank; the rest is local
    print(
        json.dumps(
            {
                "bench": "ep_step",
                "family": a.family,
                "flavor": a.flavor,
                "ep": a.ep,
                "seq": a.seq,
                "batch": a.batch,
                "rank0": r,
                "step_s_per_rank": [round(x["step_s"], 3) for x in results],
            }
        )
    )


if __name__ == "__main__":
    main()
