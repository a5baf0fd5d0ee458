"""`python -m checkpoint.convert`: our checkpoints <-> Hugging Face Llama safetensors, and `inspect`.

    to-hf CKPT OUT [--dtype float32] [--max-shard-size 5GB]   checkpoint (any parallelism) -> HF Llama dir
    from-hf HF_DIR OUT [--dtype float32]                      HF Llama dir -> model-only checkpoint
    inspect CKPT                                              list the contents, verify every checksum

The argparse layer over the library: `checkpoint.hf_conversion` converts (streaming, one shard plus one
tensor in memory; `OUT.tmp-<id>/` renamed to OUT at the end) and `checkpoint.inspection` inspects. This
is the application layer, and the one module under checkpoint/ that obtains a model family: `_adapter`
imports the registry `models.hf_adapters` when a conversion runs, never at import, and picks the family
by the checkpoint's `model.name` or `config.json`'s `model_type`. The library only ever sees the adapter
it is handed.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .format import read_index
from .hf_adapter_protocol import HFAdapter
from .hf_conversion import HF_CONFIG_FILE, from_hf, to_hf
from .inspection import inspect_checkpoint

OUT_DTYPES = ("bfloat16", "float16", "float32")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_DEFAULT_FAMILY = "llama3"  # the trainer's default model.name


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 (HF's units), '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = _SIZE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"size {text!r} is not a positive size like 5GB, 500MB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


# --------------------------------------------------------------------------- model family
def _adapter(name: object, *, what: str) -> HFAdapter[Any]:
    """The HF adapter of the family `name` names (`what`: a checkpoint's model.name or config.json's model_type);
    None (not recorded, or no config.json to read) gets the default family's, whose own checks then say what is
    missing. A name no family claims is refused, naming the ones meshtrain reads."""
    from models.hf_adapters import hf_adapter, hf_adapter_names  # the application layer's one models import

    if name is None:
        return hf_adapter(_DEFAULT_FAMILY)
    if not isinstance(name, str) or name not in hf_adapter_names():
        raise ValueError(f"{what} is {name!r}, which meshtrain does not convert; it converts {hf_adapter_names()}")
    return hf_adapter(name)


def _checkpoint_model_name(ckpt: str) -> object:
    """The model.name the checkpoint's job_config records (None without one)."""
    job = read_index(Path(ckpt)).metadata.get("job_config") or {}
    return (job.get("model") or {}).get("name")


def _hf_model_type(hf_dir: str) -> object:
    """config.json's model_type, None where it cannot be read (from_hf then names what is wrong with it)."""
    try:
        config = json.loads((Path(hf_dir) / HF_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


# -------------------------------------------------------------------------------------- CLI
def _run_inspect(ckpt: str) -> int:
    lines, problems = inspect_checkpoint(ckpt)
    for line in lines:
        print(line)  # the CLI's report is its output, not logging
    if problems and not lines:  # no checkpoint to describe (none there, or its index unreadable): why, once
        print(f"FAILED: {problems[0]}")
        return 1
    if problems:
        for p in problems:
            print(f"problem: {p}")
        print(f"FAILED: {len(problems)} problem(s) in {ckpt}; first: {problems[0]}")
        return 1
    print(f"OK: {ckpt} is intact (every checksum verified)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="export a checkpoint's model as a Hugging Face directory of its family")
    p.add_argument("ckpt", help="checkpoint directory (index.json + rank-*.safetensors)")
    p.add_argument("out", help="new output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=OUT_DTYPES, default="float32", help="dtype of the exported weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    p.add_argument("--flavor", help="flavor to assume when the checkpoint's metadata names none")
    what = "a Hugging Face Llama, Qwen3, Qwen3-MoE or DeepSeek-V3 directory"
    p = sub.add_parser("from-hf", help=f"import {what} (config.json's model_type) as a model-only checkpoint")
    p.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    p.add_argument("out", help="new checkpoint directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=OUT_DTYPES, default="float32", help="dtype of the checkpoint (training: float32)")
    p = sub.add_parser("inspect", help="list a checkpoint's contents and verify its checksums")
    p.add_argument("ckpt", help="checkpoint directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0: done / intact, 1: an error, named on the last line)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _run_inspect(args.ckpt)
        if args.command == "to-hf":
            max_shard_size = parse_size(args.max_shard_size)
            adapter = _adapter(_checkpoint_model_name(args.ckpt), what="the checkpoint's model.name")
            out = to_hf(args.ckpt, args.out, adapter, dtype=args.dtype, max_shard_size=max_shard_size,
                        flavor=args.flavor)  # fmt: skip
        else:
            adapter = _adapter(_hf_model_type(args.hf_dir), what=f"{args.hf_dir}/config.json's model_type")
            out = from_hf(args.hf_dir, args.out, adapter, dtype=args.dtype)
    except (ValueError, TypeError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
