"""Where an MoE training step goes on one CPU process, and the grouped-GEMM experts against a loop over experts.

    python bench/moe_step.py --family qwen3 --flavor debugmodel_moe [--seq 256 --batch 2 --rounds 3]

Builds the flavor (vocabulary 2048, as torchtitan_cpu.sh's tokenizer), runs forward + backward + fused AdamW, and
profiles one step into categories by op: router (the gate's matmul, softmax / sigmoid, top-k), permutation (the
sort by expert, gathers and scatters of tokens), grouped GEMM (the experts), attention (SDPA and its backward),
other matmuls (projections, shared experts, the output), optimizer, everything else. Then the same routing through
`grouped_swiglu` and `looped_swiglu` (models/common/moe.py), forward + backward, in interleaved rounds. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.common.moe import MoE, grouped_swiglu, looped_swiglu
from models.registry import job_model_args, model_family

CATEGORIES = {
    "router": ("aten::topk", "aten::softmax", "aten::_softmax", "aten::sigmoid", "aten::_softmax_backward_data",
               "aten::sigmoid_backward", "aten::gather"),
    "permutation": ("aten::sort", "aten::argsort", "aten::index_select", "aten::index_add", "aten::index_add_",
                    "aten::scatter_add_", "aten::index_select_backward", "aten::index", "aten::index_put_"),
    "grouped_gemm": ("aten::_grouped_mm",),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "optimizer": ("aten::_fused_adamw_", "Optimizer.zero_grad#AdamW.zero_grad"),
}  # fmt: skip
# SDPA's math path (DeepSeek's latent attention: values narrower than queries) and the flash kernels' wrappers
ATTENTION_COMPOSITES = ("aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention",
                        *CATEGORIES["attention"])  # fmt: skip


def _category(event, n_experts: int) -> str:
    """The event's category: that of its nearest ancestor which is a grouped GEMM or attention (their inner mm and
    softmax belong to them), else its own op's."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in CATEGORIES["grouped_gemm"] or parent.name in ATTENTION_COMPOSITES:
            return "grouped_gemm" if parent.name in CATEGORIES["grouped_gemm"] else "attention"
        parent = parent.cpu_parent
    for category, ops in CATEGORIES.items():
        if event.name in ops:
            return category
    if event.name in ATTENTION_COMPOSITES:
        return "attention"
    if event.name in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"):
        # the router's gate is the one (N, D) x (D, E) matmul (its backward: E on the inner side)
        return "router" if any(n_experts in s for s in event.input_shapes if s) else "other_matmuls"
    return "other"


def step_breakdown(family: str, flavor: str, seq: int, batch: int) -> dict[str, float]:
    args = job_model_args(family, flavor, vocab_size=2048, max_seq_len=seq)
    model = model_family(family).parts.model_class(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens, labels = torch.randint(0, 2048, (batch, seq)), torch.randint(0, 2048, (batch, seq))

    def step() -> None:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    n_experts = next(m for m in model.modules() if isinstance(m, MoE)).num_experts
    with profile(record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.events():
        seconds[_category(event, n_experts)] += event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    return {"step_s": round(wall, 3), **{k: round(v / total, 3) for k, v in sorted(seconds.items())}}


def experts_grouped_vs_loop(family: str, flavor: str, seq: int, batch: int, rounds: int) -> dict[str, float]:
    """One MoE layer's experts on the flavor's routing of random tokens, forward + backward, ms per call."""
    args = job_model_args(family, flavor, vocab_size=2048, max_seq_len=seq)
    moe = next(m for m in model_family(family).parts.model_class(args).modules() if isinstance(m, MoE))
    x = torch.randn(batch * seq, args.dim)
    with torch.no_grad():
        _, chosen = moe.router(x)
    flat = chosen.flatten()
    counts = torch.bincount(flat, minlength=moe.num_experts)
    routed = x.index_select(0, flat.argsort(stable=True) // moe.top_k).requires_grad_()
    weights = [w.detach().requires_grad_() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)]
    grad = torch.randn_like(routed)

    def run(fn) -> float:
        start = time.perf_counter()
        fn(routed, *weights, counts).backward(grad)
        return (time.perf_counter() - start) * 1e3

    times: dict[str, list[float]] = {"grouped_ms": [], "loop_ms": []}
    for _ in range(rounds + 1):  # the first round warms up
        times["grouped_ms"].append(run(grouped_swiglu))
        times["loop_ms"].append(run(looped_swiglu))
    medians = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {**{k: round(v, 1) for k, v in medians.items()}, "loop_over_grouped": round(
        medians["loop_ms"] / medians["grouped_ms"], 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--flavor", default="debugmodel_moe")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {
        "bench": "moe_step", "family": a.family, "flavor": a.flavor, "seq": a.seq, "batch": a.batch,
        "step_share": step_breakdown(a.family, a.flavor, a.seq, a.batch),
        "experts": experts_grouped_vs_loop(a.family, a.flavor, a.seq, a.batch, a.rounds),
    }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
