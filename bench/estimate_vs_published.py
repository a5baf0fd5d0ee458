"""The dry-run estimator against torchtitan's published H100 figures (issue 21).

`python bench/estimate_vs_published.py [--every_block]` runs `python -m trainer.estimate --json` once per row
(one CPU process each, fake ranks) and prints our prediction beside the published tok/s per GPU and peak
memory; `--every_block` passes the estimator's flag of that name (every block traced, not two samples).
The efficiency constants are trainer.estimate.devices' (one per device, not fitted per row). torchtitan's peak
memory is the CUDA allocator's (reserved, fragmentation and cache included), so it is compared with our
reserved peak: the step's allocations replayed through a model of that allocator (trainer.estimate.allocator);
the live tensor bytes are shown beside it.

The 405B rows run float8 linears (model.converters = ["float8"], the output left in bf16), FSDP gathering them
in float8 with precomputed scales, as torchtitan's 405B config and benchmark did; its compile is not applied
(meshtrain compiles no TP layout), so the casts are priced as eager kernels (trainer.estimate.pricing). Their
microbatches are as published: torchtitan at the
benchmark's commit (9dec370, 2024-12) split the local batch into as many microbatches as the pipeline has
stages when `pipeline_parallel_microbatches` was not set (its benchmark sets none): 8 microbatches of 4
sequences under 1F1B (8 stages), 16 of 2 under Interleaved1F1B (2 stages per rank, its default split for
looped schedules).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


@dataclass(frozen=True)
class Row:
    name: str
    config: str
    world_size: int
    overrides: tuple[str, ...]
    tokens_per_s: float
    memory_gib: float | None
    note: str


FLOAT8 = (  # torchtitan's 405B config: float8 linears but the output, FSDP gathering them in float8
    "--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
)  # fmt: skip
ROWS = (
    Row("8B FSDP 8, lbs 2, selective AC", "llama3_8b", 8,
        ("--parallelism.data_parallel_shard_degree", "8", "--training.local_batch_size", "2",
         "--activation_checkpoint.mode", "selective"),
        5762, 82.4, "eager bf16, as published"),
    Row("70B FSDP 32 x TP 8, full AC", "llama3_70b", 256,
        ("--parallelism.data_parallel_shard_degree", "32", "--parallelism.tensor_parallel_degree", "8",
         "--training.local_batch_size", "16", "--activation_checkpoint.mode", "full"),
        597, None, "published with torch.compile (bf16); predicted eager bf16; local batch 16 assumed"),
    Row("405B FSDP 8 x TP 8 x PP 8, 1F1B, lbs 32, full AC", "llama3_405b", 512,
        ("--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "8",
         "--parallelism.pipeline_parallel_degree", "8", "--parallelism.pipeline_parallel_schedule", "1F1B",
         "--training.local_batch_size", "32", "--parallelism.pipeline_parallel_microbatch_size", "4",
         "--activation_checkpoint.mode", "full",
         *FLOAT8,
         ),
        100, 82.5, "float8 as published; published compiled, predicted eager (no compile under TP)"),
    Row("405B FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, lbs 32, full AC", "llama3_405b", 512,
        ("--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "8",
         "--parallelism.pipeline_parallel_degree", "8", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--training.local_batch_size", "32", "--parallelism.pipeline_parallel_microbatch_size", "2",
         "--activation_checkpoint.mode", "full",
         *FLOAT8,
         ),
        128, 72.7, "float8 as published; published compiled, predicted eager (no compile under TP)"),
)  # fmt: skip


def predict(row: Row, *, every_block: bool) -> tuple[dict | None, str, float]:
    """The estimator's JSON for the row (None and its one-line refusal when it refuses), and the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "trainer.estimate", "--job.config_file", str(REPO / "configs" / f"{row.config}.toml"),
        *row.overrides, "--world_size", str(row.world_size), "--device", "h100", "--json",
        *(["--every_block"] if every_block else []),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return None, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed", seconds
    return json.loads(done.stdout), "", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every_block", action="store_true", help="the estimator's slower, closer reserved peak")
    every_block = parser.parse_args().every_block
    columns = ("row", "published tok/s", "predicted tok/s", "ratio", "published GiB", "reserved GiB", "ratio",
               "live GiB", "mfu", "est s", "note")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in ROWS:
        report, refusal, seconds = predict(row, every_block=every_block)
        if report is None:
            mem = f"{row.memory_gib}" if row.memory_gib else "-"
            print(f"| {row.name} | {row.tokens_per_s:,.0f} | refused | - | {mem} | - | - | - | - | {seconds:.0f} | "
                  f"{row.note}: {refusal} |")  # fmt: skip
            continue
        # torchtitan reports the maximum over all GPUs (its footnote 1): under PP, the busiest stage's
        tps = report["tokens_per_s_per_device"]
        live = max(r["memory_bytes"]["peak"] for r in report["ranks"]) / GIB
        reserved = max(r["reserved_bytes"] for r in report["ranks"]) / GIB
        mem_pub = f"{row.memory_gib}" if row.memory_gib else "-"
        mem_ratio = f"{reserved / row.memory_gib:.2f}" if row.memory_gib else "-"
        print(f"| {row.name} | {row.tokens_per_s:,.0f} | {tps:,.0f} | {tps / row.tokens_per_s:.2f} | {mem_pub} | "
              f"{reserved:.1f} | {mem_ratio} | {live:.1f} | {report['mfu']:.1%} | {seconds:.0f} | "
              f"{row.note} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
