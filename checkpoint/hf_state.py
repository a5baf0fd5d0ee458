"""The trainer's live model <-> Hugging Face safetensors folders (`checkpoint.initial_load_in_hf`,
`checkpoint.last_save_in_hf`), on `checkpoint.hf_conversion` and the model family's `HFAdapter`, which
the caller hands in (checkpoint/hf_adapter_protocol.py; Llama's is models/llama3/hf_adapter.py).

Loading maps names and the layout transforms at load time: every rank reads, with safetensors'
mmap slices, only the box of each tensor its shard holds (for a tensor whose rows HF permutes within
each head, Llama's wq / wk, the whole heads the box overlaps), so no rank ever holds the whole model.
A pipeline stage takes only its own tensors; the ranks agree on what no stage takes (refused, on every
rank) before anything is read.
Saving writes a model-only checkpoint next to the target (every rank its part, as any save) and
converts it on rank 0 with `to_hf`, which streams one tensor at a time and commits `OUT.tmp-<id>/` by
renaming it: either way a crash leaves only `*.tmp-*` leftovers, never a half-written folder under the
final name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from parallelisms.dtensor import DTensor

from .distributed import save
from .format import CheckpointError
from .hf_adapter_protocol import ArgsT, HFAdapter
from .hf_conversion import HF_CONFIG_FILE, HF_INDEX_FILE, hf_model_metadata, hf_parts, hf_weight_files, to_hf

logger = logging.getLogger(__name__)


def check_hf_folder(hf_dir: Path, key: str) -> dict[str, Path]:
    """HF tensor name -> file of the folder `hf_dir` names (config key `key`); CheckpointError with the
    fix when it is no folder of safetensors."""
    fix = (
        f"point {key} at a Hugging Face model folder (config.json and *.safetensors), or set "
        f"checkpoint.initial_load_in_hf=false to load a meshtrain checkpoint"
    )
    if not hf_dir.is_dir():
        raise CheckpointError(f"checkpoint.initial_load_in_hf: {key}={str(hf_dir)!r} is not a folder; {fix}")
    if not (hf_dir / HF_INDEX_FILE).is_file() and not any(hf_dir.glob("*.safetensors")):
        raise CheckpointError(
            f"checkpoint.initial_load_in_hf: {key}={str(hf_dir)!r} holds no .safetensors files (PyTorch .bin "
            f"checkpoints are pickles and are not read); {fix}"
        )
    try:
        return hf_weight_files(hf_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint.initial_load_in_hf: {e}; {fix}") from e


def load_hf_model(
    model: dict[str, torch.Tensor], hf_dir: Path, files: dict[str, Path], args: ArgsT, adapter: HFAdapter[ArgsT]
) -> None:
    """Fill `model` (our FQN -> this rank's DTensor or plain tensor, filled in place, cast to its dtype)
    from the HF safetensors `files` of `hf_dir` (`adapter`'s family, the model `args`); collective when a
    process group is up. Each rank takes the tensors its `model` names: a pipeline stage holds only its own
    FQNs (as `load` of a checkpoint, it leaves the others alone), so a tensor of the folder is extra only
    when no rank takes it. A tensor we stack from several of HF's (an MoE's experts) reads only the experts
    its shard holds; one HF has no place for (`not_in_hf`) is zeroed. Every missing, extra or misshapen tensor
    of any rank is reported at once, on every rank, before anything is read."""
    wanted = {name: (fqn, expert) for fqn in model for name, expert in hf_parts(adapter, fqn, args)}
    with contextlib.ExitStack() as stack:
        slices, problems = _open_slices(wanted, model, files, hf_dir, stack)
        taken, problems = _over_ranks(set(wanted), problems)
        problems = [
            *(f"{name}: not a parameter of this job's model" for name in files
              if name not in taken and not name.endswith(adapter.ignored_hf_suffixes)
              and not _tied_head(name, taken, adapter)),
            *problems,
        ]  # fmt: skip
        if problems:
            raise CheckpointError(
                f"{hf_dir} does not fit this job's model ({len(problems)} problems):\n  " + "\n  ".join(problems[:20])
            )
        for fqn, target in model.items():
            local, offset = _shard(target)
            if not local.numel():
                continue
            if adapter.not_in_hf(fqn, args):
                local.zero_()
            elif adapter.stacked_hf_names(fqn, args) is None:
                local.copy_(_read_box(slices[adapter.to_hf_name(fqn)], fqn, offset, tuple(local.shape), args, adapter))
            else:  # the experts [offset[0], offset[0] + local.shape[0]) of this shard, each its own HF tensor
                names = cast(list[str], adapter.stacked_hf_names(fqn, args))
                box = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
                for i in range(local.shape[0]):
                    local[i].copy_(slices[names[offset[0] + i]][box])


def _open_slices(
    wanted: dict[str, tuple[str, int | None]], model: dict[str, torch.Tensor], files: dict[str, Path],
    hf_dir: Path, stack: contextlib.ExitStack,
) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """(HF name -> its safetensors slice, for every tensor this rank takes that fits; this rank's problems:
    missing tensors, missing or unreadable files, other shapes). Only headers are read."""
    slices: dict[str, Any] = {}
    problems = [f"{name}: missing (for {fqn})" for name, (fqn, _) in wanted.items() if name not in files]
    opened: dict[Path, Any] = {}
    for name, (fqn, expert) in wanted.items():
        path = files.get(name)
        if path is None:
            continue
        if path not in opened:
            opened[path] = _open(path, hf_dir, stack)
        if isinstance(opened[path], str):
            problems.append(opened[path])  # said once: the problems are deduplicated below
            continue
        saved = opened[path].get_slice(name)
        shape = tuple(model[fqn].shape) if expert is None else tuple(model[fqn].shape[1:])
        if tuple(saved.get_shape()) != shape:
            what = fqn if expert is None else f"{fqn}[{expert}]"
            problems.append(f"{name}: shape {tuple(saved.get_shape())}, this job's {what} is {shape}")
            continue
        slices[name] = saved
    return slices, list(dict.fromkeys(problems))


def _open(path: Path, hf_dir: Path, stack: contextlib.ExitStack) -> Any:
    """The opened safetensors file `path`, or why it cannot be read."""
    listed = f" (listed in {hf_dir / HF_INDEX_FILE})" if (hf_dir / HF_INDEX_FILE).is_file() else ""
    if not path.is_file():
        return f"{path}{listed} is missing"
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except (OSError, SafetensorError) as e:
        return f"{path}{listed} cannot be read: {e}"


def _over_ranks(names: set[str], problems: list[str]) -> tuple[set[str], list[str]]:
    """(the HF names some rank takes, every rank's problems once, in rank order): the same on every rank, so
    all of them refuse the folder together or none does."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return names, problems
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sorted(names), problems))
    taken = {name for theirs, _ in gathered for name in theirs}
    return taken, list(dict.fromkeys(p for _, theirs in gathered for p in theirs))


def _tied_head(name: str, taken: set[str], adapter: HFAdapter[Any]) -> bool:
    """HF's lm_head.weight of a tied model, which HF itself ignores: our tied model has no output.weight (a
    pipeline's last stage holds its copy under the embedding's name), so no rank takes it."""
    return name == adapter.to_hf_name(adapter.output_fqn) and name not in taken


def _shard(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank fills and its offset in the global tensor."""
    if isinstance(target, DTensor):
        _, offset = target._spec.local_shape_and_offset()
        return target._local_tensor, tuple(offset)
    return target, (0,) * target.ndim


def _read_box(
    saved: Any,
    fqn: str,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    args: ArgsT,
    adapter: HFAdapter[ArgsT],
) -> torch.Tensor:
    """Our tensor `fqn`'s box (offset, shape) from HF's slice `saved`. Where HF permutes the rows within
    each head (Llama's wq / wk), the rows of every head the box touches are read and un-permuted."""
    box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    head_dim = adapter.rotary_head_dim(fqn, args)
    if head_dim is None:  # not a rotated projection: the same layout in both
        return saved[box]
    first, last = offset[0] // head_dim, -(-(offset[0] + shape[0]) // head_dim)  # heads [first, last)
    block = saved[(slice(first * head_dim, last * head_dim), *box[1:])]  # (heads * Dh, cols)
    ours = adapter.permute_from_hf(block, last - first)
    start = offset[0] - first * head_dim
    return ours[start : start + shape[0]]


def save_hf_model(
    model: dict[str, torch.Tensor],
    out: Path,
    adapter: HFAdapter[Any],
    *,
    dtype: str,
    metadata: dict[str, Any] | None,
    rank: int,
) -> Path:
    """Write `model` (this rank's state dict) as the Hugging Face folder `out` of `adapter`'s family in
    `dtype`; collective. CheckpointError on every rank when the conversion fails on rank 0."""
    source = out.with_name(f"{out.name}.tmp-source")  # a leftover if anything dies: removed at the next start
    target = getattr(torch, dtype)
    save({"model": {k: v.to(target) for k, v in model.items()}}, source, metadata=metadata)
    error: list[str | None] = [None]
    if rank == 0:
        try:
            to_hf(source, out, adapter, dtype=dtype)
        except (OSError, ValueError, TypeError) as e:
            error[0] = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(source, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"writing the Hugging Face folder {out} failed: {error[0]}")
    return out


def hf_job_model_args(
    path: Path,
    metadata: dict[str, Any] | None,
    check: Callable[[Path, dict[str, Any]], None],
    adapter: HFAdapter[ArgsT],
) -> ArgsT:
    """The model args the layout transforms of an HF load need (Llama's head counts): this job's, as
    `metadata` records them, else the HF folder's config.json; where the folder has one, `check(path, its
    metadata)` compares it with this job's model first."""
    theirs: ArgsT | None = None
    if (path / HF_CONFIG_FILE).is_file():
        theirs, saved = hf_model_metadata(path, adapter)
        # config.json leaves some args open (Llama's FFN width, which multiple_of and ffn_dim_multiplier spell
        # in several ways): the tensors' shapes check them
        ambiguous = adapter.hf_config_ambiguous_args
        spelled = {k: v for k, v in saved["model_args"].items() if k not in ambiguous}
        check(path, {**saved, "model_args": spelled})
    ours = (metadata or {}).get("model_args")
    if isinstance(ours, dict):
        return adapter.model_args_from_json(json.loads(json.dumps(ours)))
    if theirs is None:
        raise CheckpointError(
            f"{path} has no {HF_CONFIG_FILE} and this job records no model args: the head counts of the q/k "
            f"rotary layout are unknown; add the model's {HF_CONFIG_FILE}"
        )
    return theirs
