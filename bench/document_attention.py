"""Block-causal against causal attention: forward + backward seconds of one debug-model attention core (16 heads of
16 channels), rows of documents averaging a quarter of seq_len (lengths uniform in [seq/8, 3 seq/8]), at
seq_len 2048 and 8192, interleaved rounds, medians. Block-causal runs the per-document SDPA kernel
(models/common/documents.py), which skips every block the documents mask out; causal runs the model's causal
attention. Prints one JSON line: per seq_len the medians and block-causal / causal, and under CP (head-tail
sharding, 2 and 4 ranks) each rank's attention work on the same rows: the query-key pairs in one document it must
compute, and the pairs of the ring blocks it does compute (a block sharing no document is skipped).

    python bench/document_attention.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.common.attention import causal_attention
from models.common.documents import block_causal_attention, block_causal_mask, document_ids
from parallelisms.context_parallel import attention_block, rank_positions, ring_sources

EOS = 1


def packed_row(seq: int, generator: torch.Generator) -> torch.Tensor:
    """(1, seq) tokens: documents of uniform length in [seq/8, 3 seq/8], each ending at EOS."""
    tokens = torch.full((1, seq), 2, dtype=torch.long)
    end = 0
    while True:
        end += int(torch.randint(seq // 8, 3 * seq // 8 + 1, (), generator=generator))
        if end >= seq:
            return tokens
        tokens[0, end - 1] = EOS


def timed(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    fn(*leaves).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    result = {}
    for seq in args.seqs:
        q, k, v = (torch.randn(args.batch, 16, seq, 16, generator=g) for _ in range(3))
        documents = document_ids(torch.cat([packed_row(seq, g) for _ in range(args.batch)]), EOS)
        kernels = {
            "causal": causal_attention,
            "block_causal": lambda q, k, v, ids=documents: block_causal_attention(
                q, k, v, ids, causal=causal_attention
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, fn in kernels.items():
                times[name].append(timed(fn, q, k, v))
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        result[seq] = {
            "causal_s": round(medians["causal"], 4),
            "block_causal_s": round(medians["block_causal"], 4),
            "documents_per_row": int(documents[0, -1]) + 1,
            "block_causal_over_causal": round(medians["block_causal"] / medians["causal"], 3),
        }
        result[seq]["cp_work"] = {cp: cp_work(documents, cp) for cp in (2, 4)}
    print(json.dumps(result))


def cp_work(documents: torch.Tensor, cp: int) -> dict[str, object]:
    """Per cp rank: the query-key pairs that share a document (needed) and the pairs of the blocks it computes;
    max / min of each over the ranks."""
    seq = documents.shape[1]
    allowed = block_causal_mask(documents)[:, 0]  # (B, T, T)
    needed, computed = [], []
    for rank in range(cp):
        mine = rank_positions(seq, cp, rank, True)
        needed.append(int(allowed[:, mine].sum()))
        total = 0
        for src in ring_sources(rank, cp):
            block = attention_block(rank, src, causal=True, load_balance=True)
            if block is None:
                continue
            theirs = rank_positions(seq, cp, src, True)
            q = mine[block.queries.select(len(mine))]
            k = theirs[block.keys.select(len(theirs))]
            if bool(allowed[:, q][:, :, k].any()):
                total += documents.shape[0] * len(q) * len(k)
        computed.append(total)
    return {
        "needed_pairs": needed,
        "needed_max_over_min": round(max(needed) / min(needed), 3),
        "computed_pairs": computed,
        "computed_max_over_min": round(max(computed) / min(computed), 3),
    }


if __name__ == "__main__":
    main()
