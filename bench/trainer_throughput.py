"""Trainer throughput: global tokens/s of the debug model on CPU, one layout against another.

Runs `./run_train.sh` (torchrun) for each layout, back to back, `--repeats` times, and reads the
metrics lines (`tok/s` is per device, torchtitan's definition: local tokens / (tp x cp x pp) over the
step time). Global tokens/s = median per-device tok/s over the steps after warm-up x the number of
devices. Also the peak memory per rank (`mem`). Prints one JSON line with per-layout medians and each
layout's ratio to the first. `--train-args` passes options to every run, e.g. torchtitan's work:

    python bench/trainer_throughput.py --layouts one fsdp2 tp2 tp2_compiled --repeats 3 --steps 20 \
        --train-args "--model.tokenizer_path $A/tokenizer --training.dataset_path $A/c4_test --model.vocab_size 2048"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASYNC_TP = {"enable_async_tensor_parallel": True}  # TP's collectives as collective matmuls
LAYOUTS = {  # name: (ranks, threads per rank, dp degree, --parallelism overrides)
    "one": (1, 2, 1, {"data_parallel_shard_degree": 1}),
    "fsdp2": (2, 1, 2, {"data_parallel_shard_degree": 2}),  # also what pure data parallelism did before DDP
    "ep2": (2, 1, 2, {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}),  # torchtitan_cpu.sh's ep2
    "ddp2": (2, 1, 2, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}),
    "tp2": (2, 1, 1, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
    "tp2_async": (2, 1, 1, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2, **ASYNC_TP}),
    "fsdp2_tp2": (4, 1, 2, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp2_tp2_async": (4, 1, 2, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, **ASYNC_TP}),
    "cp2": (2, 1, 1, {"data_parallel_shard_degree": 1, "context_parallel_degree": 2}),
}
COMPILED = "_compiled"  # a layout's name with this suffix: the same layout, blocks and loss torch.compile'd (inductor)
TOKS = re.compile(r"step (\d+) \|.*tok/s ([\d,]+).*\| mem ([\d.]+)GiB")


def run(layout: str, steps: int, batch: int, seq: int, warmup: int, extra: list[str]) -> tuple[float, float, float]:
    """(global tokens/s, rank 0's peak memory GiB, the first step's seconds: it compiles) of one run."""
    ranks, threads, dp, overrides = LAYOUTS[layout.removesuffix(COMPILED)]
    args = ["./run_train.sh", "--training.steps", str(steps), "--training.local_batch_size", str(batch)]
    args += ["--compile.enable"] if layout.endswith(COMPILED) else []
    args += ["--training.seq_len", str(seq), "--job.dump_folder", f"/tmp/meshtrain-throughput-{layout}", *extra]
    for key, value in overrides.items():
        args += [f"--parallelism.{key}", str(value)]
    env = {**os.environ, "NGPU": str(ranks), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{layout} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = [(int(s), float(t.replace(",", "")), float(m)) for s, t, m in TOKS.findall(done.stdout + done.stderr)]
    per_device = [t for s, t, _ in found if s > warmup]
    first = next(t for s, t, _ in found if s == 1)  # per device: a replica's tokens / (ranks / dp) per second
    return statistics.median(per_device) * ranks, max(m for _, _, m in found), batch * seq * dp / ranks / first


def main() -> None:
    parser = argparse.ArgumentParser()
    choices = sorted([*LAYOUTS, *(name + COMPILED for name in LAYOUTS)])
    parser.add_argument("--layouts", nargs="+", default=["one", "fsdp2"], choices=choices)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--train-args", default="", help="extra trainer options for every run (one string)")
    a = parser.parse_args()
    runs: dict[str, list[float]] = {name: [] for name in a.layouts}
    mems: dict[str, list[float]] = {name: [] for name in a.layouts}
    firsts: dict[str, list[float]] = {name: [] for name in a.layouts}
    for _ in range(a.repeats):
        for name in a.layouts:  # back to back, so noise hits every layout alike
            tok_s, mem, first = run(name, a.steps, a.batch, a.seq, a.warmup, a.train_args.split())
            runs[name].append(tok_s)
            mems[name].append(mem)
            firsts[name].append(first)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    first = medians[a.layouts[0]]
    ratios = {k: v / first for k, v in medians.items()}
    first_step_s = {name: statistics.median(v) for name, v in firsts.items()}
    print(json.dumps({"global_tok_s": medians, "peak_mem_gib": mems, "first_step_s": first_step_s, "runs": runs,
                      "ratio_to_first": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
