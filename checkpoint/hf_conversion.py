"""Our checkpoints <-> Hugging Face safetensors folders, for any model family: `to_hf` and `from_hf`
(the library under `python -m checkpoint.convert`) and the reading of an HF folder.

The family's part (names, layout transforms, `config.json`, flavors) is the `HFAdapter` the caller
hands in (checkpoint/hf_adapter_protocol.py); this module never imports a model. The export streams: tensors
are assembled one at a time from their saved chunks (`read_tensor`), converted and appended to the
output shard, which is written when the next tensor would overflow `max_shard_size`. So it holds one
shard plus one tensor, whatever the model's size. Both directions write into `OUT.tmp-<id>/` and rename
it to OUT at the end, so an interrupted run leaves no half-written OUT.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .distributed import save
from .format import DTYPES, HF_CONFIG_FILE, HF_INDEX_FILE, CheckpointError, Index, read_index
from .hf_adapter_protocol import ArgsT, HFAdapter
from .reader import read_tensor
from .storage import commit, temporary_dir, write_durable, write_safetensors

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the trainer's state dict keeps the model under "model"


# ------------------------------------------------------------------------------------ to-hf
def to_hf(
    ckpt: str | Path,
    out: str | Path,
    adapter: HFAdapter[Any],
    *,
    dtype: str = "float32",
    max_shard_size: int = 5 * 10**9,
    flavor: str | None = None,
) -> Path:
    """Write the model of checkpoint `ckpt` as the Hugging Face directory `out` of `adapter`'s family
    (Llama: LlamaForCausalLM).

    The model shape comes from the checkpoint's metadata "model_args", else from its job_config's
    flavor (or `flavor`) corrected by the saved shapes; every saved shape is checked against it.
    Returns `out`."""
    ckpt, out = Path(ckpt), Path(out)
    index = read_index(ckpt)
    args = resolve_model_args(index, ckpt, adapter, flavor)
    tied = MODEL_PREFIX + adapter.output_fqn not in index.tensors
    target = DTYPES[dtype]
    shapes = adapter.parameter_shapes(args, output=not tied)
    sizes = {fqn: math.prod(shape) * target.itemsize for fqn, shape in shapes.items()}
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
                if adapter.not_in_hf(fqn, args):
                    _refuse_lost_state(fqn, w, adapter)
                    continue
                for hf_name, expert in hf_parts(adapter, fqn, args):
                    part = w if expert is None else w[expert]
                    tensors.append((hf_name, adapter.to_hf_tensor(fqn, part, args).contiguous()))
                del w  # at most one tensor beyond the shard is alive
            write_safetensors(tmp / name, tensors, {"format": "pt"})
            weight_map.update({hf_name: name for hf_name, _ in tensors})
            logger.info("wrote %s (%d tensors, %.1f MB)", name, len(tensors), sum(sizes[f] for f in shard) / 1e6)
            del tensors
        total = sum(size for fqn, size in sizes.items() if not adapter.not_in_hf(fqn, args))
        hf_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_durable(tmp / HF_INDEX_FILE, json.dumps(hf_index, indent=2) + "\n")
        config = adapter.hf_config(args, dtype=dtype, tie_word_embeddings=tied)
        write_durable(tmp / HF_CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        _commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def hf_parts(adapter: HFAdapter[ArgsT], fqn: str, args: ArgsT) -> list[tuple[str, int | None]]:
    """The HF tensors of our `fqn`: [(name, None)] for one tensor, [(name_e, e), ...] for a stack along dim 0
    (an MoE's experts), [] for a state tensor HF has no place for."""
    if adapter.not_in_hf(fqn, args):
        return []
    stacked = adapter.stacked_hf_names(fqn, args)
    if stacked is None:
        return [(adapter.to_hf_name(fqn), None)]
    return [(name, e) for e, name in enumerate(stacked)]


def _refuse_lost_state(fqn: str, w: torch.Tensor, adapter: HFAdapter[Any]) -> None:
    """A state tensor HF has no place for may be left out only when it does nothing (all zero)."""
    if torch.count_nonzero(w):
        raise ValueError(
            f"{fqn} is not zero, and {adapter.hf_architecture} has no place for it: the exported model would compute "
            f"other outputs. Train with the feature it belongs to off (for an MoE routing bias: "
            f"moe_args.load_balance_coeff = None), or export another format"
        )


def resolve_model_args(index: Index, ckpt: Path, adapter: HFAdapter[ArgsT], flavor: str | None = None) -> ArgsT:
    """The model args of the checkpoint's model, checked against every saved model shape."""
    model_keys = [k.removeprefix(MODEL_PREFIX) for k in index.tensors if k.startswith(MODEL_PREFIX)]
    if not model_keys:
        raise CheckpointError(
            f"{ckpt} has no tensors under {MODEL_PREFIX!r} (it holds {sorted(index.tensors)[:5]}...): to-hf exports "
            f"the trainer's state dict {{'model': model.state_dict(), ...}}"
        )
    meta = index.metadata
    if "model_args" in meta:
        args = adapter.model_args_from_json(meta["model_args"])
    else:
        args = _args_from_flavor(index, ckpt, model_keys, adapter, flavor)
    _check_shapes(args, index, ckpt, model_keys, adapter)
    return args


def _args_from_flavor(
    index: Index, ckpt: Path, model_keys: list[str], adapter: HFAdapter[ArgsT], flavor: str | None
) -> ArgsT:
    job = index.metadata.get("job_config") or {}
    model_cfg, training = job.get("model") or {}, job.get("training") or {}
    if model_cfg.get("name", adapter.name) != adapter.name:
        raise CheckpointError(f"{ckpt} holds a {model_cfg['name']!r} model; to-hf converts {adapter.name} only")
    flavors = adapter.flavors
    name = model_cfg.get("flavor") or flavor
    if name is None:
        raise CheckpointError(
            f"cannot tell the model's shape: {ckpt}'s metadata has neither 'model_args' nor job_config.model.flavor; "
            f"pass --flavor NAME (one of {sorted(flavors)})"
        )
    if name not in flavors:
        raise CheckpointError(f"{ckpt} was saved with flavor {name!r}, which is not one of {sorted(flavors)}")
    embedding = adapter.embedding_fqn
    vocab = index.tensors[MODEL_PREFIX + embedding].shape[0] if embedding in model_keys else None
    layers = {adapter.layer_of(k) for k in model_keys} - {None}
    return dataclasses.replace(
        flavors[name],
        vocab_size=flavors[name].vocab_size if vocab is None else vocab,
        n_layers=len(layers),
        max_seq_len=int(training.get("seq_len", flavors[name].max_seq_len)),
    )


def _check_shapes(args: ArgsT, index: Index, ckpt: Path, model_keys: list[str], adapter: HFAdapter[ArgsT]) -> None:
    tied = adapter.output_fqn not in model_keys
    expected = adapter.parameter_shapes(args, output=not tied)
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


# ---------------------------------------------------------------------------------- from-hf
def from_hf(hf_dir: str | Path, out: str | Path, adapter: HFAdapter[Any], *, dtype: str = "float32") -> Path:
    """Write the Hugging Face model of `adapter`'s family in `hf_dir` as a model-only checkpoint `out`
    that the trainer can start from (`checkpoint.initial_load_path`) at any parallelism. Returns `out`.

    A tied model (tie_word_embeddings) stays tied: its model args say so, and the checkpoint holds
    the embedding once, as a tied model's state dict does (an lm_head.weight it may also carry is
    ignored, as HF ignores it). The whole model is held in memory once, in `dtype`, since `save`
    takes the state dict at once."""
    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_existing(out)
    args, metadata = hf_model_metadata(hf_dir, adapter)
    files = hf_weight_files(hf_dir)
    tied = args.tie_word_embeddings
    head = adapter.to_hf_name(adapter.output_fqn)
    if head not in files and not tied:
        raise ValueError(f"{hf_dir} has no {head} and its config says tie_word_embeddings=false")
    expected = adapter.parameter_shapes(args)
    model = _read_hf_tensors(hf_dir, files, args, adapter, expected, DTYPES[dtype], tied)
    _refuse_existing(out)  # again: it may have appeared while reading
    if out.is_dir():
        out.rmdir()  # an empty OUT is allowed, as for to-hf; save refuses any existing directory
    return save({"model": {k: model[k] for k in expected}}, out, metadata=metadata)


def hf_model_metadata(hf_dir: Path, adapter: HFAdapter[ArgsT]) -> tuple[ArgsT, dict[str, Any]]:
    """The model args of the HF model in `hf_dir` (from its config.json) and the metadata a checkpoint
    of it records: its model args, the closest flavor and where it came from."""
    config = _read_json(hf_dir / HF_CONFIG_FILE, "the model's config.json")
    args = adapter.args_from_hf_config(config)
    return args, {
        "job_config": {"model": {"name": adapter.name, "flavor": adapter.closest_flavor(args)}},
        "model_args": adapter.model_args_to_json(args),
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
    args: ArgsT,
    adapter: HFAdapter[ArgsT],
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    tied: bool,
) -> dict[str, torch.Tensor]:
    """Our model's tensors from the HF folder (experts stacked; state tensors HF lacks at zero), every problem
    of the folder reported at once."""
    wanted = {name: (fqn, expert) for fqn in expected for name, expert in hf_parts(adapter, fqn, args)}
    head = adapter.to_hf_name(adapter.output_fqn)
    parts: dict[str, dict[int | None, torch.Tensor]] = {}
    problems: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name.endswith(adapter.ignored_hf_suffixes) or (tied and name == head):
            continue
        if name not in wanted:
            problems.append(_unwanted(name, args, adapter))
            continue
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} (listed in {hf_dir / HF_INDEX_FILE}) is missing")
        with safe_open(path, framework="pt") as f:
            for name in names:
                fqn, expert = wanted[name]
                w, shape = f.get_tensor(name), expected[fqn] if expert is None else expected[fqn][1:]
                if tuple(w.shape) != shape:
                    problems.append(f"{name}: shape {tuple(w.shape)}, config.json gives {shape}")
                    continue
                parts.setdefault(fqn, {})[expert] = adapter.from_hf_tensor(fqn, w.to(dtype), args)
    problems += [f"{name}: missing" for name, (fqn, expert) in wanted.items() if expert not in parts.get(fqn, {})]
    if problems:
        raise ValueError(
            f"{hf_dir} does not fit its config.json ({len(problems)} problems):\n  " + "\n  ".join(problems)
        )
    model = {}
    for fqn, shape in expected.items():
        if fqn not in parts:  # not_in_hf
            model[fqn] = torch.zeros(shape, dtype=dtype)
        elif None in parts[fqn]:
            model[fqn] = parts[fqn][None].contiguous()
        else:
            model[fqn] = torch.stack([parts[fqn][e] for e in range(shape[0])])
    return model


def _unwanted(name: str, args: ArgsT, adapter: HFAdapter[ArgsT]) -> str:
    """Why the HF tensor `name` has no place in the model its config.json describes."""
    try:
        adapter.from_hf_name(name)
    except KeyError:
        return f"{name}: not a {adapter.hf_architecture} parameter this model has"
    return f"{name}: beyond the model config.json describes (num_hidden_layers({args.n_layers}), the experts)"


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
