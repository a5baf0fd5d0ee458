"""Data-loading time per data-parallel rank against the dp degree: each rank reads every document of a stream
but tokenizes and packs only its rows' lanes (trainer/data/lanes.py), so its time should fall as about 1/dp.

Writes a JSON-lines dataset of `--mb` MB of generated text, then, for dp = 1, 2, 4, builds each rank's loader
(dp_rank / dp_size, in this one process, one rank after another: the ranks of a job run side by side, so a
rank's own time is what a step waits for) and times the `--batches` global batches it produces, from
construction to the last micro-batch. The tokenizer is a byte-level BPE trained on the data (`--tokenizer
bpe`, the realistic cost per byte) or the byte tokenizer (`--tokenizer byte`, where reading dominates). Prints
one JSON line: per dp degree, each rank's seconds, their max, and max(dp=1) / max(dp) (ideal: dp).

    python bench/data_loading.py --mb 4 --batches 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import build_data_loader
from trainer.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

WORDS = ("the model reads documents packed into windows of tokens and every rank takes its rows of the global "
         "batch while the loader keeps a cursor per lane so that training resumes anywhere").split()  # fmt: skip


def write_dataset(path: Path, megabytes: float, seed: int = 0) -> int:
    """Documents of 20-400 random words as JSON lines, about `megabytes` MB; returns the document count."""
    rng, size, n = random.Random(seed), 0, 0
    with path.open("w") as f:
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))}) + "\n"
            f.write(line)
            size, n = size + len(line), n + 1
    return n


def train_bpe(data: Path, folder: Path) -> Tokenizer:
    """A byte-level BPE of 4,096 tokens trained on the data, with BOS/EOS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    lines = (json.loads(line)["text"] for line in data.open())
    tok.train_from_iterator(itertools.islice(lines, 2000), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return build_tokenizer(str(folder / "tokenizer.json"))


def rank_seconds(
    data: Path, tokenizer: Tokenizer, *, dp: int, rank: int, batches: int, args: argparse.Namespace
) -> float:
    start = time.perf_counter()
    loader = build_data_loader(
        "embedded", tokenizer, dataset_path=str(data), local_batch_size=args.global_batch // dp, seq_len=args.seq_len,
        dp_rank=rank, dp_size=dp, seed=0, global_batch_size=args.global_batch,
    )  # fmt: skip
    for _ in itertools.islice(iter(loader), batches * loader.accumulation_steps):
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=4.0, help="dataset size in MB")
    parser.add_argument("--batches", type=int, default=200, help="global batches per rank")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        documents = write_dataset(data, args.mb)
        tokenizer = train_bpe(data, Path(tmp) / "tok") if args.tokenizer == "bpe" else ByteTokenizer()
        rank_seconds(data, tokenizer, dp=1, rank=0, batches=2, args=args)  # warm: imports, the datasets cache
        result: dict[str, object] = {"documents": documents, "mb": args.mb, "batches": args.batches,
                                     "global_batch": args.global_batch, "seq_len": args.seq_len,
                                     "tokenizer": args.tokenizer}  # fmt: skip
        base = None
        for dp in args.dp:
            per_rank = [
                rank_seconds(data, tokenizer, dp=dp, rank=r, batches=args.batches, args=args) for r in range(dp)
            ]
            base = base or max(per_rank)
            result[f"dp{dp}"] = {"rank_s": [round(s, 3) for s in per_rank], "max_s": round(max(per_rank), 3),
                                 "speedup": round(base / max(per_rank), 2)}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
