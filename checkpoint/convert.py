"""`python -m checkpoint.convert`: our checkpoints <-> Hugging Face Llama safetensors, and `inspect`.

    to-hf CKPT OUT [--dtype float32] [--max-shard-size 5GB]   checkpoint (any parallelism) -> HF Llama dir
    from-hf HF_DIR OUT [--dtype float32]                      HF Llama dir -> model-only checkpoint
    inspect CKPT                                              list the contents, verify every checksum

The export streams: tensors are assembled one at a time from their saved chunks (`read_tensor`),
converted and appended to the output shard, which is written when the next tensor would overflow
`--max-shard-size`. So the tool holds one shard plus one tensor, whatever the model's size. Both
directions write into `OUT.tmp-<id>/` and rename it to OUT at the end, so an interrupted run leaves
no half-written OUT. The name, rotary and config mapping itself is models/llama3/hf_adapter.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.llama3 import TransformerModelArgs, llama3_configs, parameter_shapes
from models.llama3 import hf_adapter as hf

from .distributed import save
from .format import DTYPES, INDEX_FILE, CheckpointError, FileEntry, Index, read_index
from .reader import read_tensor
from .storage import CheckedFile, commit, temporary_dir, write_durable, write_safetensors

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the trainer's state dict keeps the model under "model"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG_FILE = "config.json"
OUT_DTYPES = ("bfloat16", "float16", "float32")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


# ------------------------------------------------------------------------------------ to-hf
def to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    max_shard_size: int = 5 * 10**9,
    flavor: str | None = None,
) -> Path:
    """Write the model of checkpoint `ckpt` as a Hugging Face LlamaForCausalLM directory `out`.

    The model shape comes from the checkpoint's metadata "model_args", else from its
    job_config's llama3 flavor (or `flavor`) corrected by the saved shapes; every saved shape
    is checked against it. Returns `out`."""
    ckpt, out = Path(ckpt), Path(out)
    index = read_index(ckpt)
    args = resolve_model_args(index, ckpt, flavor)
    tied = MODEL_PREFIX + "output.weight" not in index.tensors
    target = DTYPES[dtype]
    sizes = {fqn: math.prod(shape) * target.itemsize for fqn, shape in parameter_shapes(args, output=not tied).items()}
    shards = plan_shards(sizes, max_shard_size)
    tmp = _start_output(out)
    try:
        weight_map: dict[str, str] = {}
        for k, shard in enumerate(shards, 1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            tensors = []
            for fqn in shard:
                # cast first (the saved dtype goes at once), then permute: exact either way
                w = read_tensor(ckpt, MODEL_PREFIX + fqn, index=index).to(target)
                tensors.append((hf.to_hf_name(fqn), hf.to_hf_tensor(fqn, w, args).contiguous()))
                del w  # at most one tensor beyond the shard is alive
            write_safetensors(tmp / name, tensors, {"format": "pt"})
            weight_map.update({hf_name: name for hf_name, _ in tensors})
            logger.info("wrote %s (%d tensors, %.1f MB)", name, len(tensors), sum(sizes[f] for f in shard) / 1e6)
            del tensors
        hf_index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        write_durable(tmp / HF_INDEX_FILE, json.dumps(hf_index, indent=2) + "\n")
        config = hf.hf_config(args, dtype=dtype, tie_word_embeddings=tied)
        write_durable(tmp / HF_CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        _commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_args(index: Index, ckpt: Path, flavor: str | None = None) -> TransformerModelArgs:
    """The model args of the checkpoint's model, checked against every saved model shape."""
    model_keys = [k.removeprefix(MODEL_PREFIX) for k in index.tensors if k.startswith(MODEL_PREFIX)]
    if not model_keys:
        raise CheckpointError(
            f"{ckpt} has no tensors under {MODEL_PREFIX!r} (it holds {sorted(index.tensors)[:5]}...): to-hf exports "
            f"the trainer's state dict {{'model': model.state_dict(), ...}}"
        )
    meta = index.metadata
    if "model_args" in meta:
        args = hf.model_args_from_json(meta["model_args"])
    else:
        args = _args_from_flavor(index, ckpt, model_keys, flavor)
    _check_shapes(args, index, ckpt, model_keys)
    return args


def _args_from_flavor(index: Index, ckpt: Path, model_keys: list[str], flavor: str | None) -> TransformerModelArgs:
    job = index.metadata.get("job_config") or {}
    model_cfg, training = job.get("model") or {}, job.get("training") or {}
    if model_cfg.get("name", "llama3") != "llama3":
        raise CheckpointError(f"{ckpt} holds a {model_cfg['name']!r} model; to-hf converts llama3 only")
    name = model_cfg.get("flavor") or flavor
    if name is None:
        raise CheckpointError(
            f"cannot tell the model's shape: {ckpt}'s metadata has neither 'model_args' nor job_config.model.flavor; "
            f"pass --flavor NAME (one of {sorted(llama3_configs)})"
        )
    if name not in llama3_configs:
        raise CheckpointError(f"{ckpt} was saved with flavor {name!r}, which is not one of {sorted(llama3_configs)}")
    embedding = (
        index.tensors[MODEL_PREFIX + "tok_embeddings.weight"].shape if "tok_embeddings.weight" in model_keys else None
    )
    layers = {hf.layer_of(k) for k in model_keys} - {None}
    return dataclasses.replace(
        llama3_configs[name],
        vocab_size=embedding[0] if embedding else llama3_configs[name].vocab_size,
        n_layers=len(layers),
        max_seq_len=int(training.get("seq_len", llama3_configs[name].max_seq_len)),
    )


def _check_shapes(args: TransformerModelArgs, index: Index, ckpt: Path, model_keys: list[str]) -> None:
    tied = "output.weight" not in model_keys
    expected = parameter_shapes(args, output=not tied)
    problems = [f"{k}: missing" for k in expected if k not in model_keys]
    problems += [f"{k}: not a parameter of this model" for k in model_keys if k not in expected]
    for k in model_keys:
        saved = index.tensors[MODEL_PREFIX + k].shape
        if k in expected and saved != expected[k]:
            problems.append(f"{k}: saved {saved}, the model args give {expected[k]}")
    if problems:
        raise CheckpointError(
            f"{ckpt}'s model does not match its model args {args} ({len(problems)} problems):\n  "
            + "\n  ".join(problems[:20])
        )


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Group keys (in order) into shards of at most `max_shard_size` bytes; a larger tensor gets a
    shard of its own (as HF's `save_pretrained`)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for key, size in sizes.items():
        if shards[-1] and filled + size > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += size
    return shards


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 (HF's units), '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = _SIZE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"size {text!r} is not a positive size like 5GB, 500MB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


# ---------------------------------------------------------------------------------- from-hf
def from_hf(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face Llama in `hf_dir` as a model-only checkpoint `out` that the trainer
    can start from (`checkpoint.initial_load_path`) at any parallelism. Returns `out`.

    A tied model (tie_word_embeddings) stays tied: its model args say so, and the checkpoint holds
    the embedding once, as a tied Transformer's state dict does (an lm_head.weight it may also
    carry is ignored, as HF ignores it). The whole model is held in memory once, in `dtype`, since
    `save` takes the state dict at once."""
    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_existing(out)
    args, metadata = hf_model_metadata(hf_dir)
    files = hf_weight_files(hf_dir)
    tied = args.tie_word_embeddings
    if "lm_head.weight" not in files and not tied:
        raise ValueError(f"{hf_dir} has no lm_head.weight and its config says tie_word_embeddings=false")
    expected = parameter_shapes(args)
    model = _read_hf_tensors(hf_dir, files, args, expected, DTYPES[dtype], tied)
    _refuse_existing(out)  # again: it may have appeared while reading
    if out.is_dir():
        out.rmdir()  # an empty OUT is allowed, as for to-hf; save refuses any existing directory
    return save({"model": {k: model[k] for k in expected}}, out, metadata=metadata)


def hf_model_metadata(hf_dir: Path) -> tuple[TransformerModelArgs, dict[str, Any]]:
    """The model args of the HF Llama in `hf_dir` (from its config.json) and the metadata a checkpoint
    of it records: its model args, the closest llama3 flavor and where it came from."""
    config = _read_json(hf_dir / HF_CONFIG_FILE, "the model's config.json")
    args = hf.args_from_hf_config(config)
    return args, {
        "job_config": {"model": {"name": "llama3", "flavor": hf.closest_flavor(args)}},
        "model_args": hf.model_args_to_json(args),
        "converted_from": {"hf_dir": str(hf_dir), "architectures": config.get("architectures")},
    }


def hf_weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded with an index, or one file)."""
    if (hf_dir / HF_INDEX_FILE).is_file():
        weight_map = _read_json(hf_dir / HF_INDEX_FILE, "the weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{hf_dir / HF_INDEX_FILE} has no weight_map (tensor name -> file)")
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = sorted(hf_dir.glob("*.safetensors"))
    if len(single) != 1:
        raise FileNotFoundError(
            f"{hf_dir} has no {HF_INDEX_FILE} and {len(single)} .safetensors files; expected the index or exactly "
            f"one model.safetensors (PyTorch .bin checkpoints are not read: they are pickles)"
        )
    with safe_open(single[0], framework="pt") as f:
        return {name: single[0] for name in f.keys()}


def _read_hf_tensors(
    hf_dir: Path,
    files: dict[str, Path],
    args: TransformerModelArgs,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    tied: bool,
) -> dict[str, torch.Tensor]:
    model, problems = {}, []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not name.endswith(hf.HF_IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight"):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} (listed in {hf_dir / HF_INDEX_FILE}) is missing")
        with safe_open(path, framework="pt") as f:
            for name in names:
                try:
                    fqn = hf.from_hf_name(name)
                except KeyError:
                    problems.append(f"{name}: not a LlamaForCausalLM parameter this model has")
                    continue
                if fqn not in expected:
                    problems.append(f"{name}: beyond num_hidden_layers({args.n_layers}) of config.json")
                    continue
                w = f.get_tensor(name)
                if tuple(w.shape) != expected[fqn]:
                    problems.append(f"{name}: shape {tuple(w.shape)}, config.json gives {expected[fqn]}")
                    continue
                model[fqn] = hf.from_hf_tensor(fqn, w.to(dtype), args).contiguous()
    problems += [f"{hf.to_hf_name(k)}: missing" for k in expected if k not in model]
    if problems:
        raise ValueError(
            f"{hf_dir} does not fit its config.json ({len(problems)} problems):\n  " + "\n  ".join(problems)
        )
    return model


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} ({what}) does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} ({what}) is not valid JSON: {e}") from e


# ------------------------------------------------------------------------------ output dir
def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory; choose a new OUT or remove it")


def _start_output(out: Path) -> Path:
    """A fresh `OUT.tmp-<id>/` next to `out`; refuses an `out` that exists and is not an empty directory."""
    _refuse_existing(out)
    tmp = temporary_dir(out, uuid.uuid4().hex[:12])
    tmp.mkdir(parents=True)
    return tmp


def _commit_output(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, as a checkpoint is committed (an empty `out` makes way)."""
    if out.is_dir():
        out.rmdir()  # only ever empty here (_refuse_existing)
    commit(tmp, out)


# ---------------------------------------------------------------------------------- inspect
def inspect_checkpoint(ckpt: str | Path) -> tuple[list[str], list[str]]:
    """(report lines, problems) for checkpoint `ckpt`: its contents, and every file's CRC-32
    blocks verified. No problems means the checkpoint is intact."""
    ckpt = Path(ckpt)
    try:
        index = read_index(ckpt)
    except CheckpointError as e:
        return [], [str(e)]
    lines = _describe(index, ckpt)
    problems = _check_chunks(index)
    for name, entry in index.files.items():
        problem = verify_file(ckpt / name, entry)
        lines.append(f"  {name}: {entry.size:,} bytes, {len(entry.crc32)} blocks: {problem or 'ok'}")
        if problem:
            problems.append(f"{ckpt / name}: {problem}")
    extra = sorted(p.name for p in ckpt.iterdir() if p.name != INDEX_FILE and p.name not in index.files)
    if extra:
        lines.append(f"  not in the index (ignored by load): {extra}")
    return lines, problems


def _describe(index: Index, ckpt: Path) -> list[str]:
    total = sum(math.prod(t.shape) * DTYPES[t.dtype].itemsize for t in index.tensors.values())
    lines = [f"checkpoint {ckpt}: saved by {index.world_size} rank(s)"]
    job = index.metadata.get("job_config") or {}
    for section in ("model", "parallelism"):
        if section in job:
            lines.append(f"  {section}: {json.dumps(job[section], sort_keys=True)}")
    if "model_args" in index.metadata:
        lines.append(f"  model_args: {json.dumps(index.metadata['model_args'], sort_keys=True)}")
    lines.append(f"tensors: {len(index.tensors)}, {total:,} bytes")
    width = max((len(k) for k in index.tensors), default=0)
    for key, t in index.tensors.items():
        lines.append(f"  {key:<{width}}  {t.dtype:<8}  {list(t.shape)!s:<16}  chunks={len(t.chunks)}  {t.layout}")
    lines.append(f"values: {len(index.values)}: {', '.join(index.values) or '-'}")
    lines.append(f"files: {len(index.files)}, {sum(f.size for f in index.files.values()):,} bytes")
    return lines


def _check_chunks(index: Index) -> list[str]:
    """Each chunk's byte range fits its shape, and the chunks add up to the whole tensor."""
    problems = []
    for key, t in index.tensors.items():
        itemsize = DTYPES[t.dtype].itemsize
        bad = [c for c in t.chunks if c.end - c.begin != math.prod(c.shape) * itemsize]
        covered = sum(math.prod(c.shape) for c in t.chunks)
        if bad:
            problems.append(f"index: {key}: chunk {bad[0].key} spans {bad[0].end - bad[0].begin} bytes for shape "
                            f"{list(bad[0].shape)}")  # fmt: skip
        elif covered != math.prod(t.shape):
            problems.append(f"index: {key}: chunks hold {covered} elements of {math.prod(t.shape)}")
    return problems


def verify_file(path: Path, entry: FileEntry) -> str | None:
    """Why `path` does not match its index entry (missing, wrong size, first bad block), or None:
    the loader's own verified reads (`CheckedFile`), one block at a time over the whole file."""
    if not path.is_file():
        return "missing"
    try:
        checked = CheckedFile(path, entry, verify=True)
    except CheckpointError as e:
        return str(e)
    buffer = memoryview(bytearray(entry.block_size))
    try:
        for lo in range(0, entry.size, entry.block_size):
            checked.read_into(lo, buffer[: min(entry.block_size, entry.size - lo)])
    except CheckpointError as e:
        return str(e)
    finally:
        checked.close()
    return None


def _run_inspect(ckpt: str) -> int:
    lines, problems = inspect_checkpoint(ckpt)
    for line in lines:
        print(line)  # the CLI's report is its output, not logging
    if problems:
        for p in problems:
            print(f"problem: {p}")
        print(f"FAILED: {len(problems)} problem(s) in {ckpt}; first: {problems[0]}")
        return 1
    print(f"OK: {ckpt} is intact (every checksum verified)")
    return 0


# -------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="export a checkpoint's model as a Hugging Face Llama directory")
    p.add_argument("ckpt", help="checkpoint directory (index.json + rank-*.safetensors)")
    p.add_argument("out", help="new output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=OUT_DTYPES, default="float32", help="dtype of the exported weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    p.add_argument("--flavor", help="llama3 flavor to assume when the checkpoint's metadata names none")
    p = sub.add_parser("from-hf", help="import a Hugging Face Llama directory as a model-only checkpoint")
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
            out = to_hf(args.ckpt, args.out, dtype=args.dtype, max_shard_size=parse_size(args.max_shard_size),
                        flavor=args.flavor)  # fmt: skip
        else:
            out = from_hf(args.hf_dir, args.out, dtype=args.dtype)
    except (ValueError, TypeError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
