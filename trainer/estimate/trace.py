"""One traced training step of one rank: the estimator's measurement, on fake tensors or real ones.

`trace_step` builds the model with the trainer's own recipe (build_model on meta, parallelize_llama under
the runtime's mesh, init_model, build_job_optimizer) and runs `trainer.step.train_step` once over the step's
micro-batches, while `LiveBytes` accounts every storage (estimate_memory) and `MeshCommDebugMode` counts
the collectives by kind and mesh dim. Under `fake=True` every tensor is a FakeTensor (no memory, no
data) and the process group may be a fake one of any size; with `fake=False` it is a real run (the tests
run it on gloo worlds and compare the two).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from models.common.decoder import Decoder
from models.registry import flops_per_token, job_model_args, model_family
from parallelisms.dtensor import DeviceMesh, DTensor
from parallelisms.dtensor.debug import CommDebugMode, _defers_to_subclass, counted_collective
from parallelisms.fsdp import MixedPrecisionPolicy
from parallelisms.parallel_dims import FLATTENED, MESH_ORDER, ParallelDims

from ..build import assemble_pipeline, build_job_optimizer, build_model, init_model, to_training_dtype
from ..config.data_files import accumulation_steps
from ..config.sections import JobConfig
from ..moe_balance import register_expert_balancing
from ..pipeline_training import pipeline_train_step, split_for_rank
from ..runtime import Runtime
from ..step import MicroBatches, global_target_count, train_step
from ..tokenizer import build_model_tokenizer, model_vocab_size
from .live_bytes import LiveBytes, MemoryReport, track_live_bytes


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind on one mesh dim in a step: how many, and the payload bytes this rank handed them."""

    kind: str  # all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single, broadcast, ...
    mesh_dim: str  # a mesh dim or flattened dim name ("tp", "dp_shard", "dp", "dp_cp", ...), "world" or "other"
    count: int
    bytes: int


@dataclass(frozen=True)
class StepTrace:
    """What one rank's step held, sent and computed."""

    memory: MemoryReport
    collectives: list[Collective]
    comm_counts: dict[str, int]  # CommDebugMode's counts by kind (the oracle the tests compare)
    comm_bytes: dict[str, int]
    executed_flops: int  # this rank's, recomputation included
    flops_per_token: float  # model FLOPs per token (trainer.metrics.flops_per_token)
    local_tokens: int  # tokens this rank's data-parallel group consumed in the step
    n_layers: int
    float8_flops: int = 0  # the part of executed_flops in float8 matmuls (model.converters = ["float8"])
    float8_casts: int = 0  # elements cast to float8 in the step (each one a pass over memory)


def _kind(key: Any) -> str:
    return str(getattr(key, "_qualified_op_name", key)).split("::")[-1]


def group_names(mesh: DeviceMesh, dims: ParallelDims) -> dict[str, str]:
    """Process group name -> the mesh dim it serves, in the layout's terms. A flattened dim goes by its one dim of
    degree > 1 when it has one (dp_shard_cp without cp is "dp_shard"); a base dim's name wins over a flattened
    one. Under expert parallelism dp_shard is two mesh dims, "dp_shard" together; alone they keep their names
    where no other dim serves their group (FSDP of the experts: "dp_shard_mod_ep")."""
    names: dict[str, str] = {dist.group.WORLD.group_name: "world"}  # type: ignore[union-attr]
    mesh_dims = list(enumerate(mesh.mesh_dim_names or ()))
    for i, dim in mesh_dims:
        if dim not in MESH_ORDER:
            names[mesh.get_group(i).group_name] = dim
    for flat, parts in FLATTENED.items():
        present = [d for d in parts if getattr(dims, d) > 1]
        with contextlib.suppress(KeyError, ValueError, RuntimeError):  # one dim present: it goes by that dim's name
            names[mesh[flat].get_group().group_name] = present[0] if len(present) == 1 else flat
    for i, dim in mesh_dims:
        if dim in MESH_ORDER:
            names[mesh.get_group(i).group_name] = dim
    return names


def ep_group_name(mesh: DeviceMesh, dims: ParallelDims) -> str | None:
    """The group of expert parallelism's all-to-alls (None without EP). It may serve other dims too (on 8 ranks,
    ep 8 and dp_shard 8 are one group): an all-to-all on it is "ep", its other collectives go by `group_names`."""
    return mesh["ep"].get_group().group_name if dims.ep_enabled else None


def _groups_of(runtime: Runtime) -> tuple[dict[str, str], str | None]:
    mesh, dims = runtime.world_mesh, runtime.parallel_dims
    return group_names(mesh, dims), ep_group_name(mesh, dims)


class _NoModuleTracking:
    """Stands in for CommDebugMode's module tracker. torch's ModuleTracker (under it) hooks every module's
    outputs with multi-grad hooks that keep the activation gradients alive until the step ends: measured on
    8B under TP 8, 1.7 GiB of them at the optimizer step that the trainer, which runs no tracker, never holds."""

    parents: frozenset[str] = frozenset()
    is_bw = False

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: object) -> None:
        return None


class MeshCommDebugMode(CommDebugMode):
    """CommDebugMode that also counts each collective under the mesh dim of its process group (and, to
    leave the step's memory as the trainer's, without attributing collectives to modules)."""

    def __init__(self, groups: dict[str, str], ep_group: str | None = None) -> None:
        super().__init__()
        self._modules = _NoModuleTracking()  # type: ignore[assignment]
        self.groups = groups
        self.ep_group = ep_group  # all-to-alls on this group are expert parallelism's ("ep")
        self.by_dim: defaultdict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counted = None if any(_defers_to_subclass(t) for t in types) else counted_collective(func, args)
        if counted is not None:
            key, nbytes = counted
            kind = _kind(key)
            dim = self._mesh_dim(kind, [*args, *(kwargs or {}).values()])
            record = self.by_dim[(kind, dim)]
            record[0] += 1
            record[1] += nbytes
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _mesh_dim(self, kind: str, values: list[Any]) -> str:
        for v in values:
            if isinstance(v, torch.ScriptObject):  # how the dispatcher passes a ProcessGroup
                with contextlib.suppress(RuntimeError, TypeError):
                    v = dist.ProcessGroup.unbox(v)
            name = v.group_name if isinstance(v, dist.ProcessGroup) else v if isinstance(v, str) else None
            if name is None or not (isinstance(v, dist.ProcessGroup) or name in self.groups or name == self.ep_group):
                continue
            if name == self.ep_group and kind.startswith("all_to_all"):
                return "ep"
            return self.groups.get(name, "other")
        return "other"

    def collectives(self) -> list[Collective]:
        return [Collective(k, d, c, b) for (k, d), (c, b) in sorted(self.by_dim.items())]


class RealTensorsStayReal(TorchDispatchMode):
    """Under FakeTensorMode, run an op whose tensor inputs are all real (a DeviceMesh's rank bookkeeping, e.g.
    `(ranks == rank).nonzero()` when a step slices a mesh) on the real tensors, outside every mode: faking it
    would make its data-dependent output unknowable. Factories, ops on fake tensors and ops on meta tensors (a
    meta-built DTensor's shards becoming fake ones in `to_empty`) go on to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_defers_to_subclass(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class GroupedMMInAnyDtype(TorchDispatchMode):
    """Fake tensors' `_grouped_mm` (torch's meta function) takes bfloat16 only, the CUDA kernel's fast path; the
    kernel falls back to a loop of matmuls in float32 (and the CPU runs any dtype). An MoE's experts see float32
    without FSDP's bfloat16 parameters (DDP, TP, PP or CP alone; mixed_precision_param = float32): their fake
    grouped GEMM runs in bfloat16 and its output takes the inputs' dtype, the shape being the same."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or {args[0].dtype, args[1].dtype} == {torch.bfloat16}:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
        return out.to(kwargs.get("out_dtype") or a.dtype)


def _parallelize(cfg: JobConfig, runtime: Runtime, model: torch.nn.Module) -> None:
    """Parallelize the model on meta as trainer.train.build_model_and_optimizer does."""
    mp_policy = MixedPrecisionPolicy(param_dtype=runtime.precision.param, reduce_dtype=runtime.precision.reduce)
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    model_family(cfg.model.name).parts.parallelize(
        model, runtime.parallel_dims, runtime.world_mesh, loss_parallel=runtime.loss_parallel,
        ac_mode=ac.mode, ac_selective_option=ac.selective_ac_option, ac_early_stop=ac.early_stop,
        ac_force_recompute_mm_fqns=tuple(ac.per_op_sac_force_recompute_mm_shapes_by_fqns),
        mp_policy=mp_policy, reshard_after_forward=p.fsdp_reshard_after_forward == "always"
        or (p.fsdp_reshard_after_forward == "default" and p.pipeline_parallel_degree == 1),  # as train.py
        cp_rotate_method=p.context_parallel_rotate_method,
    )  # fmt: skip


def job_vocab_size(cfg: JobConfig) -> int:
    """model.vocab_size when set (no tokenizer needed: production configs name one not shipped), else the
    tokenizer's, as the trainer resolves it."""
    if cfg.model.vocab_size > 0:
        return cfg.model.vocab_size
    return model_vocab_size(build_model_tokenizer(cfg.model.tokenizer_path, cfg.model.hf_assets_path), 0)


def _tokens(vocab: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, shape, device=device)  # (B, T)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _allocate(cfg: JobConfig, model: torch.nn.Module, device: torch.device, *, fake: bool) -> None:
    """Allocate the parallelized model's (or pipeline part's) shards on `device` as trainer.train does."""
    if fake:  # the same storages; the random fills draw seeds with .item(), which fake tensors lack
        model.to_empty(device=device)
        if cast(Any, model.model_args).tie_word_embeddings:
            model.tie_weights()  # type: ignore[operator]
        with torch.device(device):
            model.freqs_cis = model.rotary_table()  # type: ignore[operator]
    else:
        init_model(model, device)  # type: ignore[arg-type]
    to_training_dtype(model, cfg.training.dtype)


def _step_setup(
    cfg: JobConfig, runtime: Runtime, vocab_size: int | None, n_layers: int | None = None
) -> tuple[int, int, Decoder, float]:
    """(vocab size, micro-batches per step, the model on meta (its first `n_layers` blocks only, when given),
    the whole model's FLOPs per token), as the trainer has them."""
    vocab = vocab_size or job_vocab_size(cfg)
    training = cfg.training
    global_batch = training.global_batch_size if training.global_batch_size > 0 else 0
    n_micro = accumulation_steps(global_batch, training.local_batch_size, runtime.dp_size) if global_batch else 1
    torch.manual_seed(int(training.seed or 0))
    fpt = _whole_model_flops_per_token(cfg.model.name, cfg.model.flavor, vocab, training.seq_len)
    return vocab, n_micro, build_model(cfg, vocab, n_layers=n_layers, causal=True), fpt


def _whole_model_flops_per_token(name: str, flavor: str, vocab: int, seq_len: int) -> float:
    """The trainer's FLOPs per token of the whole model (models/registry.py: flops_per_token), from its shapes."""
    return flops_per_token(name, job_model_args(name, flavor, vocab_size=vocab, max_seq_len=seq_len), seq_len)


def _fake_tensors(fake: bool) -> contextlib.ExitStack:
    """The context a traced step runs in: fake tensors (real ones the job already holds stay real), or nothing."""
    fakes = contextlib.ExitStack()
    if fake:
        fakes.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        fakes.enter_context(RealTensorsStayReal())
        fakes.enter_context(GroupedMMInAnyDtype())
    return fakes


def trace_step(
    cfg: JobConfig, runtime: Runtime, *, fake: bool, vocab_size: int | None = None, layers: int | None = None
) -> StepTrace:
    """Build the model with the trainer's recipe and run one training step on this rank, traced; with `layers`
    only the first `layers` blocks are kept (see `trace_step_sampled`)."""
    vocab, n_micro, model, fpt = _step_setup(cfg, runtime, vocab_size, n_layers=layers)  # fpt: the whole model's
    training = cfg.training
    n_layers = model.model_args.n_layers
    _parallelize(cfg, runtime, model)
    comm = MeshCommDebugMode(*_groups_of(runtime))
    with _fake_tensors(fake), track_live_bytes() as live:
        _allocate(cfg, model, runtime.device, fake=fake)
        optimizer = build_job_optimizer(cfg, model)
        register_expert_balancing(model, optimizer, runtime.dp_cp_mesh)  # its all-reduce, as the trainer's
        shape = (training.local_batch_size, training.seq_len)
        micro = [(_tokens(vocab, shape, runtime.device), _tokens(vocab, shape, runtime.device)) for _ in range(n_micro)]

        def step(local: MicroBatches, targets: torch.Tensor) -> None:
            train_step(
                model, optimizer, local, targets=targets, grad_average_size=runtime.grad_average_size,
                max_norm=training.max_norm, use_loss_parallel=runtime.loss_parallel, skip_nonfinite=False,
                autocast=runtime.precision.autocast,
            )  # fmt: skip

        position = StepPosition([model], optimizer)
        return _measured_step(live, comm, position, model, optimizer, runtime, micro, step, fpt=fpt, n_layers=n_layers)


def _measured_step(
    live: LiveBytes, comm: MeshCommDebugMode, position: StepPosition, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer, runtime: Runtime, micro: MicroBatches,
    step: Callable[[MicroBatches, torch.Tensor], None], *, fpt: float, n_layers: int,
) -> StepTrace:  # fmt: skip
    """Run `step` once over this rank's share of `micro` (context parallelism shards each sequence), under the
    live-bytes tracker and the collective counter, and read the trace off them."""
    _create_optimizer_state(model, optimizer)
    live.where, live.stage = position.where, position.stage
    live.reset_peak()
    live.flops = live.float8_flops = live.float8_casts = 0
    local = runtime.shard_sequences(micro)
    with comm:
        step(local, global_target_count([y for _, y in local], runtime.dp_cp_mesh))
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    memory = live.report(params=params, grads=grads, optimizer=states)
    position.remove()
    return StepTrace(
        memory=memory, collectives=comm.collectives(),
        comm_counts={_kind(k): v for k, v in comm.get_comm_counts().items()},
        comm_bytes={_kind(k): v for k, v in comm.get_comm_bytes().items()},
        executed_flops=live.flops, float8_flops=live.float8_flops, float8_casts=live.float8_casts,
        flops_per_token=fpt, local_tokens=sum(x.numel() for x, _ in micro), n_layers=n_layers,
    )  # fmt: skip


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its state before the measured step, as every step after the first has it: the peak
    reported is a steady step's (torchtitan reads memory mid-run), not the first step's, which lacks it. One
    step on zero gradients makes the state; the moments stay zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_pipeline_step(
    cfg: JobConfig, runtime: Runtime, *, fake: bool, vocab_size: int | None = None, n_layers: int | None = None
) -> StepTrace:
    """`trace_step` of this rank's pipeline stages: the trainer's split (`runtime.pipeline`), parallelization and
    schedule, every microbatch of the step run (so the schedule's activation peak is the one measured). `n_layers`:
    the model's blocks when they are not the flavor's (a sampled variant, `sampling.py`)."""
    assert runtime.pipeline is not None, "a pipeline step's runtime holds its pipeline setup"
    vocab, n_micro, whole, fpt = _step_setup(cfg, runtime, vocab_size, n_layers=n_layers)
    training = cfg.training
    pp_mesh = runtime.world_mesh["pp"]
    parts, stage_ids = split_for_rank(runtime.pipeline, whole, pp_mesh.get_local_rank())
    for part in parts:
        _parallelize(cfg, runtime, part)
    comm = MeshCommDebugMode(*_groups_of(runtime))
    with _fake_tensors(fake), track_live_bytes() as live:
        for part in parts:
            _allocate(cfg, part, runtime.device, fake=fake)
        model = assemble_pipeline(cfg, runtime, whole, parts, stage_ids)
        optimizer = build_job_optimizer(cfg, model)
        register_expert_balancing(model, optimizer, runtime.dp_cp_mesh)  # its all-reduce, as the trainer's
        shape = (training.local_batch_size, training.seq_len)
        micro = [(_tokens(vocab, shape, runtime.device), _tokens(vocab, shape, runtime.device)) for _ in range(n_micro)]

        def step(local: MicroBatches, targets: torch.Tensor) -> None:
            pipeline_train_step(
                model.pipeline, optimizer, local, targets=targets, grad_average_size=runtime.grad_average_size,
                max_norm=training.max_norm, use_loss_parallel=runtime.loss_parallel,
            )  # fmt: skip

        position = StepPosition(list(parts), optimizer)
        blocks = sum(len(part.layers) for part in parts)
        return _measured_step(live, comm, position, model, optimizer, runtime, micro, step, fpt=fpt, n_layers=blocks)


class StepPosition:
    """Where the step is, for the peak's report: the stage (forward / backward / optimizer), and the module
    last entered in the forward or the block whose backward runs (a hook on each block's output gradient,
    which holds nothing past its call)."""

    def __init__(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self.module, self.stepping = "", False
        names = {id(m): name for model in models for name, m in model.named_modules() if name}
        self._handles = [
            register_module_forward_pre_hook(lambda m, _: self._enter(names.get(id(m)))),
            optimizer.register_step_pre_hook(lambda *_: setattr(self, "stepping", True)),
            optimizer.register_step_post_hook(lambda *_: setattr(self, "stepping", False)),
        ]
        for model in models:  # a pipeline rank's parts, or the one model
            for name, block in model.layers.items():  # type: ignore[union-attr, operator]
                self._handles.append(block.register_forward_hook(self._block_hook(f"layers.{name}")))

    def _enter(self, name: str | None) -> None:
        if name is not None:
            self.module = name

    def _block_hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: setattr(self, "module", name))

        return hook

    def stage(self) -> str:
        if self.stepping:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def where(self) -> str:
        stage = self.stage()
        return "optimizer step" if stage == "optimizer" else f"{stage} {self.module}".strip()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
