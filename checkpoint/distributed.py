"""`save`, `async_save` and `load` of distributed state dicts (docs/architecture.md §5).

Saving: every rank works out, from the tensors' global shapes and placements alone, which rank
holds which box of every tensor and which one writes it (`planner.assign_owners`: each replicated
box once, bytes balanced). Each rank writes the boxes it owns to its own safetensors file in
`step-N.tmp-<id>/`; the ranks gather their files' sizes and checksums on rank 0, which writes
`index.json` and renames the directory to `step-N/`. Until that rename nothing is committed.

Loading needs no communication: each rank reads the index, checks every requested key against it
(all problems reported at once), and fills its shards in place from the byte ranges of the saved
chunks that overlap them (`planner.read_plan`), whatever layout saved them.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import uuid
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallelisms.dtensor import DTensor, Partial, Replicate

from .format import DTYPES, INDEX_FILE, CheckpointError, ChunkEntry, Index, TensorEntry, dtype_name, read_index
from .planner import Chunk, Holding, assign_owners, holdings
from .reader import fill_tensors
from .state_tree import Leaf, flatten, set_value
from .storage import WrittenFile, commit, temporary_dir, write_durable, write_safetensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One tensor of a state dict as this rank sees it."""

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    held: list[Holding]  # the box of every rank holding it
    local: torch.Tensor | None  # this rank's shard; None off the tensor's mesh
    layout: str


def _describe(value: torch.Tensor, world_size: int) -> _Tensor:
    if isinstance(value, DTensor):
        spec, mesh = value._spec, value.device_mesh
        on_mesh = mesh.get_coordinate() is not None
        return _Tensor(
            value.dtype, tuple(value.shape), holdings(value.shape, mesh.mesh, spec.placements),
            value._local_tensor if on_mesh else None, f"{'|'.join(map(str, spec.placements))} on {mesh.shape}",
        )  # fmt: skip
    full = Chunk((0,) * value.ndim, tuple(value.shape))  # a plain tensor: the same on every rank
    return _Tensor(value.dtype, tuple(value.shape), [Holding(r, full) for r in range(world_size)], value, "plain")


def _chunk_key(key: str, offset: tuple[int, ...]) -> str:
    return f"{key}@{','.join(map(str, offset))}"


# ------------------------------------------------------------------------------------ saving
@dataclass
class _StagedSave:
    """Everything a rank needs to write its part and commit, detached from the live state."""

    final: Path
    tmp: Path
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    tensors: dict[str, _Tensor]
    owners: dict[str, list[Holding]]
    mine: list[tuple[str, torch.Tensor]]  # (chunk key, contiguous CPU data) this rank writes
    values: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def write_and_commit(self) -> Path:
        try:
            written: WrittenFile | None = None
            if self.mine:
                written = write_safetensors(self.tmp / f"rank-{self.rank}.safetensors", self.mine)
            report: tuple[int, WrittenFile | None, str | None] = (self.rank, written, None)
        except Exception as e:  # reported to every rank, so none waits forever on the others
            report = (self.rank, None, f"rank {self.rank}: {type(e).__name__}: {e}")
        reports: list[Any] = [report]
        if self.world_size > 1:
            reports = [None] * self.world_size
            dist.all_gather_object(reports, report, group=self.group)
        status: list[Any] = [self._commit(reports) if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(status, src=0, group=self.group)
        if status[0] is not None:
            raise CheckpointError(f"saving {self.final} failed, nothing was committed: {status[0]}")
        return self.final

    def _commit(self, reports: list[tuple[int, WrittenFile | None, str | None]]) -> str | None:
        errors = [e for _, _, e in reports if e]
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            files = {r: w for r, w, _ in reports if w is not None}
            write_durable(self.tmp / INDEX_FILE, self._index(files).to_json())
            commit(self.tmp, self.final)
        except Exception as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return str(e)
        return None

    def _index(self, files: dict[int, WrittenFile]) -> Index:
        entries = {}
        for key, t in self.tensors.items():
            chunks = []
            for h in self.owners[key]:
                ckey = _chunk_key(key, h.chunk.offset)
                begin, end = files[h.rank].ranges[ckey]
                chunks.append(ChunkEntry(h.chunk.offset, h.chunk.shape, f"rank-{h.rank}.safetensors", ckey, begin, end))
            entries[key] = TensorEntry(dtype_name(t.dtype), t.global_shape, tuple(chunks), t.layout)
        file_entries = {f"rank-{r}.safetensors": w.entry for r, w in sorted(files.items())}
        return Index(self.world_size, entries, file_entries, self.values, self.metadata)


def save(
    state_dict: dict[str, Any],
    directory: str | Path,
    *,
    process_group: dist.ProcessGroup | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Save `state_dict` (nested dicts/lists of DTensors, tensors and JSON values) as the committed
    checkpoint `directory`; collective over every rank of `process_group` (default: the world).
    Refuses to write into an existing checkpoint. Returns the committed directory."""
    return _stage(state_dict, Path(directory), process_group, metadata, copy=False).write_and_commit()


def async_save(
    state_dict: dict[str, Any],
    directory: str | Path,
    *,
    process_group: dist.ProcessGroup | None,
    executor: ThreadPoolExecutor,
    metadata: dict[str, Any] | None = None,
) -> Future[Path]:
    """Stage `state_dict` to CPU memory (pinned on CUDA) now, write and commit it on `executor`'s
    thread. `process_group` must be used by nothing else while the save runs (a dedicated
    `dist.new_group(backend="gloo")`): the commit's collectives run on that thread. The caller
    waits on the future before the next save and before exiting."""
    staged = _stage(state_dict, Path(directory), process_group, metadata, copy=True)
    return executor.submit(staged.write_and_commit)


def _stage(
    state_dict: dict[str, Any],
    final: Path,
    group: dist.ProcessGroup | None,
    metadata: dict[str, Any] | None,
    *,
    copy: bool,
) -> _StagedSave:
    # without a process group (a conversion tool) this is a world of one
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world_size > 1 and dist.get_world_size(group) != world_size:
        raise ValueError("checkpoint saving needs a process group over the whole world")
    tensors, values = {}, {}
    for key, leaf in sorted(flatten(state_dict).items()):
        if isinstance(leaf.value, torch.Tensor):
            tensors[key] = _describe(_reduced(leaf.value), world_size)
        else:
            values[key] = leaf.value
    if world_size > 1:
        tensors, values = _merge_ranks(tensors, values, group, rank)
    owners = assign_owners({k: (t.dtype.itemsize, t.held) for k, t in tensors.items()})
    mine = []
    for key, t in tensors.items():
        for h in owners[key]:
            if h.rank == rank:
                assert t.local is not None, f"{key}: rank {rank} owns a chunk it does not hold"
                mine.append((_chunk_key(key, h.chunk.offset), _to_cpu(t.local, copy=copy)))
    tmp = _start_directory(final, group, rank, world_size)
    return _StagedSave(final, tmp, rank, world_size, group, tensors, owners, mine, values, dict(metadata or {}))


def _reduced(value: torch.Tensor) -> torch.Tensor:
    """A DTensor with Partial placements is reduced (to Replicate on those dims) before saving: a
    checkpoint stores values, not pending sums."""
    if isinstance(value, DTensor) and any(isinstance(p, Partial) for p in value.placements):
        placements = [Replicate() if isinstance(p, Partial) else p for p in value.placements]
        return value.redistribute(value.device_mesh, placements)
    return value  # only its local tensor is read (detached when staged), so no DTensor op runs


def _to_cpu(t: torch.Tensor, *, copy: bool) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    staged.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return staged


def _merge_ranks(
    tensors: dict[str, _Tensor], values: dict[str, Any], group: dist.ProcessGroup | None, rank: int
) -> tuple[dict[str, _Tensor], dict[str, Any]]:
    """The checkpoint's tensors and values over every rank of `group`.

    SPMD ranks pass the same keys (one all_gather of a digest says so, the common case). Pipeline stages pass
    only their own: then the ranks exchange what they hold and each key is saved from the ranks that have
    it (a plain tensor is the same on each of them). A key two ranks describe differently (shape, dtype,
    placements, or another JSON value) is refused, naming both ranks.
    """
    described = {
        k: (str(t.dtype), t.global_shape, t.layout, [(h.rank, h.chunk) for h in t.held]) for k, t in tensors.items()
    }
    digest = hashlib.sha256(repr((sorted(described.items()), sorted(values.items(), key=repr))).encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if all(torch.equal(d, mine) for d in everyone):
        return tensors, values
    mine_plain = {k: (d[0], d[1], d[2]) for k, d in described.items()}
    lists: list[Any] = [None] * len(everyone)
    dist.all_gather_object(lists, (mine_plain, {k: d[3] for k, d in described.items()}, values), group=group)
    merged_tensors: dict[str, _Tensor] = {}
    first_seen: dict[str, tuple[int, Any]] = {}
    holders: dict[str, list[int]] = {}
    for r, (their_tensors, _, their_values) in enumerate(lists):
        for key, desc in their_tensors.items():
            seen = first_seen.setdefault(key, (r, desc))
            if seen[1] != desc:
                raise ValueError(
                    f"ranks {seen[0]} and {r} save {key!r} differently: {seen[1]} vs {desc} (dtype, global shape, "
                    f"placements); every rank holding a tensor must describe it alike"
                )
            holders.setdefault(key, []).append(r)
        for key, value in their_values.items():
            if values.setdefault(key, value) != value:
                raise ValueError(f"ranks save different values for {key!r}: {values[key]!r} vs {value!r} (rank {r})")
    for key, (r, (dtype, shape, layout)) in sorted(first_seen.items()):
        if layout == "plain":  # the same on every rank that holds it
            full = Chunk((0,) * len(shape), tuple(shape))
            held = [Holding(h, full) for h in holders[key]]
        else:
            held = [Holding(h, chunk) for h, chunk in lists[r][1][key]]
        local = tensors[key].local if key in tensors else None
        merged_tensors[key] = _Tensor(DTYPES[dtype.removeprefix("torch.")], shape, held, local, layout)
    return merged_tensors, values


def _start_directory(final: Path, group: dist.ProcessGroup | None, rank: int, world_size: int) -> Path:
    """Rank 0 creates `final.tmp-<id>` (refusing an existing `final`) and tells the others."""
    answer: list[Any] = [None]
    if rank == 0:
        if final.exists():
            answer[0] = ("error", f"{final} already exists; a committed checkpoint is never overwritten")
        else:
            tmp = temporary_dir(final, uuid.uuid4().hex[:12])
            try:
                tmp.mkdir(parents=True)
                answer[0] = ("ok", str(tmp))
            except OSError as e:
                answer[0] = ("error", f"cannot create {tmp}: {e}")
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0, group=group)
    status, detail = answer[0]
    if status != "ok":
        raise FileExistsError(detail) if "already exists" in detail else CheckpointError(detail)
    return Path(detail)


# ----------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class LoadResult:
    loaded: list[str]  # flat keys filled from the checkpoint
    skipped: list[str]  # keys allowed to differ that did not match (left as they were), with why


def load(
    state_dict: dict[str, Any],
    directory: str | Path,
    *,
    verify: bool = True,
    allow_mismatch: Collection[str] = (),
) -> LoadResult:
    """Fill `state_dict` in place from the checkpoint `directory`: its tensors (any layout, any
    world size) and JSON values. Keys the checkpoint has but `state_dict` lacks are ignored.
    Missing keys, wrong global shapes and dtypes are all reported in one CheckpointError, except
    under keys (or key prefixes ending in ".") listed in `allow_mismatch`, which are left as they
    are. `verify` checks the CRC-32 of every block read."""
    directory = Path(directory)
    index = read_index(directory)
    flat = flatten(state_dict)
    problems, skipped = [], []
    tensors: dict[str, Leaf] = {}
    values: dict[str, Leaf] = {}
    for key, leaf in flat.items():
        problem = _mismatch(key, leaf.value, index)
        if problem is None:
            (tensors if isinstance(leaf.value, torch.Tensor) else values)[key] = leaf
        elif any(key == a or (a.endswith(".") and key.startswith(a)) for a in allow_mismatch):
            skipped.append(f"{key}: {problem}")
        else:
            problems.append(f"{key}: {problem}")
    if problems:
        raise CheckpointError(
            f"{directory} does not fit the state dict ({len(problems)} problems):\n  " + "\n  ".join(problems)
        )
    fill_tensors({k: leaf.value for k, leaf in tensors.items()}, index, directory, verify=verify)
    for key, leaf in values.items():
        set_value(state_dict, leaf.path, index.values[key])
    return LoadResult(sorted(tensors) + sorted(values), skipped)


def _mismatch(key: str, value: Any, index: Index) -> str | None:
    if not isinstance(value, torch.Tensor):
        return None if key in index.values else "missing from the checkpoint"
    entry = index.tensors.get(key)
    if entry is None:
        return "missing from the checkpoint" + (" (saved as a value)" if key in index.values else "")
    if entry.shape != tuple(value.shape):
        return f"global shape {tuple(value.shape)} here, {entry.shape} in the checkpoint"
    if DTYPES[entry.dtype] != value.dtype:
        return f"dtype {dtype_name(value.dtype)} here, {entry.dtype} in the checkpoint (never cast silently)"
    if isinstance(value, DTensor) and any(isinstance(p, Partial) for p in value.placements):
        return f"placements {value.placements} include Partial, which cannot be loaded into; use Replicate"
    return None
