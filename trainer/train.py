"""Training entry point: `python -m trainer.train --job.config_file FILE [--section.key value ...]`.

Owns the job's lifecycle: config, logging, the process group and mesh, the model and its
parallelization, and the loop (forward, cross-entropy, backward, clip, step). Only this module sees
the whole JobConfig; every `build_*` gets its own section or explicit arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.lr_scheduler import LambdaLR

from checkpoint.manager import CheckpointManager
from checkpoint.stateful import ModelState, OptimizerState, RngState, Stateful
from models.llama3 import Transformer, TransformerModelArgs, llama3_configs
from models.llama3.parallelize import data_parallel_mesh, parallelize_llama
from parallelisms.data_parallel import ReplicateModule
from parallelisms.dtensor import DeviceMesh, DTensor, Partial
from parallelisms.dtensor.init import layout_invariant_init
from parallelisms.fsdp import FSDPModule, MixedPrecisionPolicy
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import loss_parallel

from .config import Comm, JobConfig, Parallelism, load_config, save_config, to_toml
from .data import TokenBatches, build_data_loader
from .dump_folder import lock_dump_folder
from .failure import report_failure, under_torchelastic
from .garbage import GarbageCollection
from .loss import IGNORE_INDEX, CrossEntropy, build_cross_entropy, summed_cross_entropy, token_loss_sum
from .lr_schedule import build_lr_scheduler
from .metrics import MetricsLogger, flops_per_token
from .optim import build_optimizer
from .preflight import check_config
from .profiling import Profiler
from .tokenizer import Tokenizer, build_model_tokenizer, model_vocab_size
from .train_state import TrainState
from .validate import ScalarWriter, Validator, build_held_out_windows

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- setup
def setup_logging(rank: int) -> None:
    """`[rank0] time LEVEL module: msg`; ranks not in LOG_RANK (default "0") only log warnings."""
    log_ranks = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip()}
    logging.basicConfig(
        level=logging.INFO if rank in log_ranks else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def build_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU (gloo)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, comm: Comm) -> bool:
    """Join torchrun's world, or a 1-rank world when run without torchrun. Reuses an existing default
    process group (e.g. a test world). Returns whether this call created it (and so must destroy it)."""
    if dist.is_initialized():
        return False
    # torch.distributed.nn.functional binds group.WORLD into its functions' default arguments when
    # first imported, which would keep the default group alive past destroy_process_group() until
    # interpreter exit (see teardown). torch._dynamo imports it lazily (the optimizer's first step
    # does), so import it now, while group.WORLD is still None.
    importlib.import_module("torch.distributed.nn.functional")

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def build_parallel_dims(cfg: Parallelism, world_size: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=cfg.data_parallel_replicate_degree,
        dp_shard=cfg.data_parallel_shard_degree,
        cp=cfg.context_parallel_degree,
        tp=cfg.tensor_parallel_degree,
        pp=cfg.pipeline_parallel_degree,
        world_size=world_size,
    )


def check_unsupported(cfg: JobConfig, device: torch.device) -> None:
    """Fail early, with the fix, on options whose support depends on the device (the pre-flight, which
    may run where the job does not, accepts them)."""
    if cfg.model.converters:
        need = "CUDA float8/MX matmuls (H100 or newer)" if device.type != "cuda" else "torchao's converted linears"
        raise NotImplementedError(
            f"model.converters={cfg.model.converters}: float8/MX training is not implemented in meshtrain (it needs "
            f"{need}; this job runs on {device.type}); set model.converters=[] to train in "
            f"{cfg.training.mixed_precision_param if device.type == 'cuda' else 'float32'}"
        )


def build_model(cfg: JobConfig, vocab_size: int) -> Transformer:
    """The flavor's Transformer on the meta device (no memory; `init_model` allocates the shards
    after parallelization), its vocabulary the tokenizer's and max_seq_len seq_len."""
    if cfg.model.name != "llama3":
        raise ValueError(f"model.name={cfg.model.name!r}: only 'llama3' is available")
    if cfg.model.flavor not in llama3_configs:
        raise ValueError(f"model.flavor={cfg.model.flavor!r}: expected one of {sorted(llama3_configs)}")
    args = dataclasses.replace(
        llama3_configs[cfg.model.flavor], vocab_size=vocab_size, max_seq_len=cfg.training.seq_len
    )
    with torch.device("meta"):
        return Transformer(args)


def init_model(model: Transformer, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and initialize them. Under one seed the global
    weights are bitwise the same on every layout and world size (layout_invariant_init), so no
    seed checkpoint is needed; no rank ever holds more than its shards."""
    model.to_empty(device=device)
    with layout_invariant_init():
        model.init_weights(buffer_device=device)


def dp_coordinates(parallel_dims: ParallelDims, world_mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) on the data-loading "dp" dim; (0, 1) when there is no data parallelism."""
    dp_size = parallel_dims.dp_replicate * parallel_dims.dp_shard
    if dp_size == 1:
        return 0, 1
    return world_mesh["dp"].get_local_rank(), dp_size


# -------------------------------------------------------------------------------------- step
def reduce_loss(loss: torch.Tensor, parallel_dims: ParallelDims, world_mesh: DeviceMesh) -> float:
    """The loss averaged over the data-parallel ranks (each saw a different batch), as a float."""
    loss = loss.detach()
    if isinstance(loss, DTensor):  # under loss_parallel: a DTensor over tp
        loss = loss.full_tensor()
    if parallel_dims.dp_cp_enabled:
        loss = DTensor.from_local(loss, world_mesh["dp_cp"], [Partial("avg")]).full_tensor()
    return loss.item()


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean token loss (averaging over dp gives it)
    grad_norm: torch.Tensor  # the global gradient 2-norm before clipping (0-d, on the device)
    skipped: bool  # a non-finite step whose optimizer update was skipped


class NonfiniteWatch:
    """Remembers, on the device, the first step whose gradient norm was not finite, so the default
    (stop on NaN/inf) costs no host sync per step: `check` reads it where the loop syncs anyway (the
    log step, before a checkpoint is saved, at the end) and stops the job naming that step."""

    def __init__(self, device: torch.device) -> None:
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # 0: every step so far was finite

    def note(self, step: int, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(grad_norm) & (self.first == 0)
        self.first = torch.where(bad, step, self.first)

    def check(self) -> None:
        first = int(self.first.item())
        if first:
            raise FloatingPointError(
                f"step {first}: the gradient norm is not finite (a non-finite loss or gradient); lower "
                f"optimizer.lr or raise lr_scheduler.warmup_steps, or set training.skip_nonfinite_steps=true "
                f"to skip such steps"
            )


def global_target_count(
    labels: list[torch.Tensor], parallel_dims: ParallelDims, world_mesh: DeviceMesh
) -> torch.Tensor:
    """Targets (ignore_index excluded) in the whole step: every micro-batch on every dp rank.
    One all_reduce of a scalar, left on the device (no host sync)."""
    local = sum((lab != IGNORE_INDEX).sum() for lab in labels).to(torch.float32)  # type: ignore[union-attr]
    if parallel_dims.dp_cp_enabled:
        local = DTensor.from_local(local, world_mesh["dp_cp"], [Partial("sum")]).full_tensor()
    return local


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    targets: torch.Tensor,
    dp_size: int,
    max_norm: float,
    use_loss_parallel: bool,
    skip_nonfinite: bool,
    autocast: torch.dtype | None = None,
    cross_entropy: CrossEntropy = summed_cross_entropy,
) -> StepResult:
    """One optimizer step over `micro_batches` (gradient accumulation; FSDP reduces only after
    the last). The loss is the sum of token losses over the whole step divided by its `targets`
    (the global count), not a mean of means; times `dp_size` because FSDP and DDP average gradients
    over the dp ranks. With `skip_nonfinite` a non-finite gradient norm skips the update (deciding
    needs the norm on the host: one sync per step in that mode only); otherwise the loop's
    NonfiniteWatch stops the job at its next check.
    `autocast`: run forward and loss under torch.autocast in this dtype (mixed precision without FSDP)."""
    optimizer.zero_grad(set_to_none=True)
    scale = dp_size / targets
    total: torch.Tensor | None = None
    accumulate = isinstance(model, (FSDPModule, ReplicateModule)) and len(micro_batches) > 1
    for i, (inputs, labels) in enumerate(micro_batches):
        if accumulate and i in (0, len(micro_batches) - 1):  # off for the first, on for the last
            model.set_requires_gradient_sync(i > 0)  # type: ignore[operator]
        token_sum = token_loss_sum(
            model, inputs, labels, autocast=autocast, vocab_parallel=use_loss_parallel, cross_entropy=cross_entropy
        )
        loss = token_sum * scale
        # the backward too runs inside loss_parallel, as torch requires (a fresh context per
        # micro-batch: a generator context cannot be entered twice)
        with loss_parallel() if use_loss_parallel else contextlib.nullcontext():
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None, "a step needs at least one micro-batch"
    params = [p for p in model.parameters() if p.grad is not None]
    clip = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if skip_nonfinite and not math.isfinite(grad_norm.item()):
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, skipped=True)
    optimizer.step()
    return StepResult(total, grad_norm, skipped=False)


def tokens_per_device(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], parallel_dims: ParallelDims) -> int:
    """This step's tokens per device, torchtitan's definition behind tok/s and MFU: the ranks of one
    tp x cp x pp group all process the same local tokens, so each device is credited its share."""
    return sum(inputs.numel() for inputs, _ in micro_batches) // parallel_dims.non_data_parallel_size


def use_loss_parallel(cfg: JobConfig, parallel_dims: ParallelDims) -> bool:
    """Logits stay sharded on the vocabulary for the loss: only with TP, and when enabled."""
    return parallel_dims.tp_enabled and cfg.parallelism.enable_loss_parallel


@dataclass(frozen=True)
class Runtime:
    """Where the job runs: its parallel degrees, the world mesh and this rank's device."""

    parallel_dims: ParallelDims
    world_mesh: DeviceMesh
    device: torch.device

    @property
    def dp_size(self) -> int:
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard


@dataclass(frozen=True)
class Components:
    """Everything the loop drives; each stateful piece owns its state (`state_dict`) and the
    checkpointer saves them all."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: TokenBatches
    train_state: TrainState
    metrics: MetricsLogger
    checkpointer: CheckpointManager | None
    validator: Validator | None  # None: validation off
    profiler: Profiler  # entered around the loop; a no-op when profiling is off

    def close(self) -> None:
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()  # an async save in flight is committed before the job ends
        finally:
            self.metrics.close()


def compute_dtypes(cfg: JobConfig, device: torch.device) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param, reduce) dtypes of mixed precision; (None, None), plain float32, on the CPU."""
    if device.type != "cuda":
        return None, None
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    param, reduce = dtypes[cfg.training.mixed_precision_param], dtypes[cfg.training.mixed_precision_reduce]
    return (None if param == torch.float32 else param), reduce


def autocast_dtype(cfg: JobConfig, runtime: Runtime) -> torch.dtype | None:
    """Without FSDP nothing casts the parameters, so the forward runs under torch.autocast in the
    mixed-precision dtype (torchtitan's choice on one device); None when FSDP does it or in float32."""
    param_dtype, _ = compute_dtypes(cfg, runtime.device)
    fsdp = data_parallel_mesh(runtime.parallel_dims, runtime.world_mesh) is not None
    return None if fsdp else param_dtype


def precision_summary(cfg: JobConfig, runtime: Runtime) -> str:
    if compute_dtypes(cfg, runtime.device)[0] is None:
        where = "" if runtime.device.type == "cuda" else " (the CPU ignores training.mixed_precision_*)"
        return f"float32{where}"
    how = "autocast" if autocast_dtype(cfg, runtime) else f"FSDP params, {cfg.training.mixed_precision_reduce} reduce"
    return f"mixed precision {cfg.training.mixed_precision_param} ({how})"


def build_model_and_optimizer(
    cfg: JobConfig, runtime: Runtime, vocab_size: int
) -> tuple[nn.Module, torch.optim.Optimizer, LambdaLR]:
    """The parallelized, initialized model, its optimizer and lr scheduler."""
    # identical on every rank (run_job resolved a None seed): the init fills stay in step
    torch.manual_seed(cast(int, cfg.training.seed))
    model = build_model(cfg, vocab_size)
    param_dtype, reduce_dtype = compute_dtypes(cfg, runtime.device)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    parallelize_llama(
        model, runtime.parallel_dims, runtime.world_mesh, loss_parallel=use_loss_parallel(cfg, runtime.parallel_dims),
        ac_mode=ac.mode, ac_selective_option=ac.selective_ac_option, ac_early_stop=ac.early_stop, mp_policy=mp_policy,
        reshard_after_forward=p.fsdp_reshard_after_forward != "never",  # "default": always, until PP exists
        compile_backend=cfg.compile.backend if cfg.compile.enable and "model" in cfg.compile.components else None,
    )  # fmt: skip
    init_model(model, runtime.device)
    if cfg.training.dtype == "bfloat16":  # torchtitan's training.dtype: no float32 master weights at all
        model.to(torch.bfloat16)
    opt = cfg.optimizer
    optimizer = build_optimizer(
        model, name=opt.name, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2),
        implementation=opt.implementation,
    )  # fmt: skip
    sched = cfg.lr_scheduler
    scheduler = build_lr_scheduler(
        optimizer, warmup_steps=sched.warmup_steps, total_steps=cfg.training.steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    )  # fmt: skip
    return model, optimizer, scheduler


def build_components(cfg: JobConfig, runtime: Runtime) -> Components:
    """Model, optimizer, scheduler, data, metrics and checkpointer, resumed from the latest
    checkpoint when there is one (`train_state.step` is then the step to continue after)."""
    training = cfg.training
    tokenizer = build_model_tokenizer(cfg.model.tokenizer_path, cfg.model.hf_assets_path)
    model, optimizer, scheduler = build_model_and_optimizer(
        cfg, runtime, model_vocab_size(tokenizer, cfg.model.vocab_size)
    )
    dp_rank, dp_size = dp_coordinates(runtime.parallel_dims, runtime.world_mesh)
    loader = build_data_loader(
        training.dataset, tokenizer, dataset_path=training.dataset_path, text_field=training.dataset_text_field,
        local_batch_size=training.local_batch_size, seq_len=training.seq_len,
        dp_rank=dp_rank, dp_size=dp_size, seed=training.seed,
        global_batch_size=training.global_batch_size if training.global_batch_size > 0 else None,
    )  # fmt: skip
    args = cast(TransformerModelArgs, model.model_args)
    fpt = flops_per_token(
        model, n_layers=args.n_layers, n_heads=args.n_heads, head_dim=args.head_dim, seq_len=training.seq_len
    )
    tb_folder = tensorboard_folder(cfg, dist.get_rank())
    metrics = MetricsLogger(
        flops_per_token=fpt, device=runtime.device, total_steps=training.steps, tb_folder=tb_folder,
        peak_tflops_override=cfg.metrics.peak_tflops, rank=dist.get_rank(),
    )  # fmt: skip
    train_state = TrainState()
    checkpointer = build_checkpointer(cfg, model, optimizer, scheduler, loader, train_state)
    validator = build_validator(cfg, runtime, tokenizer, writer=metrics.writer)
    profiler = Profiler(cfg.profiling, dump_folder=Path(cfg.job.dump_folder), rank=dist.get_rank(),
                        device=runtime.device, global_step=train_state.step)  # fmt: skip
    return Components(model, optimizer, scheduler, loader, train_state, metrics, checkpointer, validator, profiler)


def tensorboard_folder(cfg: JobConfig, rank: int) -> Path | None:
    """dump_folder/save_tb_folder on rank 0, or rank_<R> under it on every rank with save_for_all_ranks."""
    m = cfg.metrics
    if not m.enable_tensorboard or (rank != 0 and not m.save_for_all_ranks):
        return None
    folder = Path(cfg.job.dump_folder) / m.save_tb_folder
    return folder / f"rank_{rank}" if m.save_for_all_ranks else folder


def build_validator(
    cfg: JobConfig, runtime: Runtime, tokenizer: Tokenizer, *, writer: ScalarWriter | None
) -> Validator | None:
    """The held-out loss every validation.freq steps; its batch size and seq_len default to training's."""
    val, training = cfg.validation, cfg.training
    if not val.enable:
        return None
    source = build_held_out_windows(
        val.dataset, tokenizer, dataset_path=val.dataset_path, text_field=training.dataset_text_field,
        seq_len=val.seq_len or training.seq_len, seed=training.seed,
    )  # fmt: skip
    dp_rank, dp_size = dp_coordinates(runtime.parallel_dims, runtime.world_mesh)
    return Validator(
        source, freq=val.freq, steps=val.steps, local_batch_size=val.local_batch_size or training.local_batch_size,
        last_step=training.steps, dp_rank=dp_rank, dp_size=dp_size,
        dp_mesh=runtime.world_mesh["dp_cp"] if runtime.parallel_dims.dp_cp_enabled else None,
        use_loss_parallel=use_loss_parallel(cfg, runtime.parallel_dims), device=runtime.device, writer=writer,
        autocast=autocast_dtype(cfg, runtime),
    )  # fmt: skip


def build_checkpointer(
    cfg: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR, loader: TokenBatches,
    train_state: TrainState,
) -> CheckpointManager | None:  # fmt: skip
    """The checkpoint manager over every stateful component, resumed (or initialized) already; None when it
    has nothing to do. An initial checkpoint loads whether or not saving is enabled."""
    ckpt = cfg.checkpoint
    if not (ckpt.enable or ckpt.initial_load_path or ckpt.initial_load_in_hf or ckpt.create_seed_checkpoint):
        return None
    options = {k: v for k, v in dataclasses.asdict(ckpt).items() if k != "folder"}
    options["hf_assets_path"] = cfg.model.hf_assets_path  # initial_load_in_hf's folder when initial_load_path is ""
    states: dict[str, Stateful] = {
        "model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "lr_scheduler": scheduler,
        "dataloader": loader, "train_state": train_state, "rng": RngState(),
    }  # fmt: skip
    model_args = cast(TransformerModelArgs, model.model_args)
    metadata = {"job_config": cfg.to_dict(), "model_args": dataclasses.asdict(model_args)}
    manager = CheckpointManager(Path(cfg.job.dump_folder) / cfg.checkpoint.folder, states, metadata=metadata, **options)
    train_state.step = manager.load()
    return manager


def train(cfg: JobConfig, runtime: Runtime) -> list[float]:
    """Build everything from `cfg` and train up to `cfg.training.steps`; returns the logged losses."""
    c = build_components(cfg, runtime)
    if c.checkpointer is not None and c.checkpointer.created_seed:  # checkpoint.create_seed_checkpoint
        c.close()
        return []
    training = cfg.training
    logger.info(
        "training %s/%s (%.2fM params) for %d steps on %s: %s, global batch %d x %d tokens (%d micro-batches of %d), "
        "%s",
        cfg.model.name, cfg.model.flavor, sum(p.numel() for p in c.model.parameters()) / 1e6, training.steps,
        runtime.device, runtime.world_mesh, c.loader.global_batch, training.seq_len, c.loader.accumulation_steps,
        training.local_batch_size, precision_summary(cfg, runtime),
    )  # fmt: skip
    try:
        with c.profiler:
            return train_loop(cfg, runtime, c)
    finally:
        c.close()


def train_loop(cfg: JobConfig, runtime: Runtime, c: Components) -> list[float]:
    """Steps `c.train_state.step + 1 .. training.steps`: fetch, step, log, save."""
    training, state = cfg.training, c.train_state
    batches = iter(c.loader)
    loss_parallel_on = use_loss_parallel(cfg, runtime.parallel_dims)
    losses: list[float] = []
    amp_dtype = autocast_dtype(cfg, runtime)
    compile_loss = cfg.compile.enable and "loss" in cfg.compile.components and not loss_parallel_on
    cross_entropy = build_cross_entropy(cfg.compile.backend if compile_loss else None)
    nonfinite = NonfiniteWatch(runtime.device)
    c.metrics.begin(state)
    tokens_since, data_since, t0 = 0, 0.0, time.perf_counter()
    first_step, skipped_in_a_row = state.step + 1, 0
    with GarbageCollection(training.gc_freq, debug=training.gc_debug) as collector:
        for step in range(first_step, training.steps + 1):
            fetch = time.perf_counter()
            micro = [(x.to(runtime.device), y.to(runtime.device)) for x, y in
                     (next(batches) for _ in range(c.loader.accumulation_steps))]  # fmt: skip
            data_since += time.perf_counter() - fetch  # next(batches) and the host-to-device copies
            lr = float(c.scheduler.get_last_lr()[0])
            result = train_step(
                c.model, c.optimizer, micro,
                targets=global_target_count([lab for _, lab in micro], runtime.parallel_dims, runtime.world_mesh),
                dp_size=runtime.dp_size, max_norm=training.max_norm, use_loss_parallel=loss_parallel_on,
                skip_nonfinite=training.skip_nonfinite_steps, autocast=amp_dtype, cross_entropy=cross_entropy,
            )  # fmt: skip
            if not training.skip_nonfinite_steps:
                nonfinite.note(step, result.grad_norm)
            if result.skipped:
                state.skipped_steps += 1
                skipped_in_a_row += 1
                logger.warning("step %d: non-finite gradient norm, optimizer step skipped (%d so far)", step,
                               state.skipped_steps)  # fmt: skip
                check_skips(step, skipped_in_a_row, training.max_consecutive_skipped_steps)
            else:
                skipped_in_a_row = 0
            c.scheduler.step()
            state.step = step
            state.tokens_seen += sum(x.numel() for x, _ in micro) * runtime.dp_size
            tokens_since += tokens_per_device(micro, runtime.parallel_dims)
            if step % cfg.metrics.log_freq == 0 or step == training.steps:
                global_loss = reduce_loss(result.loss, runtime.parallel_dims, runtime.world_mesh)
                if runtime.device.type == "cuda":
                    torch.cuda.synchronize(runtime.device)
                nonfinite.check()  # the host waits here anyway
                c.metrics.log(step, loss=global_loss, grad_norm=float(result.grad_norm), lr=lr, tokens=tokens_since,
                              seconds=time.perf_counter() - t0, data_seconds=data_since)  # fmt: skip
                losses.append(global_loss)
                tokens_since, data_since, t0 = 0, 0.0, time.perf_counter()
            if c.checkpointer is not None and c.checkpointer.is_due(step, last=step == training.steps):
                nonfinite.check()  # never save weights a non-finite step has already spoilt
                saving = time.perf_counter()
                c.checkpointer.save_if_due(step, last=step == training.steps)
                t0 += time.perf_counter() - saving  # a save is not training: tok/s leaves it out
            if c.validator is not None and c.validator.should_validate(step):
                validating = time.perf_counter()
                c.validator.validate(c.model, step)
                t0 += time.perf_counter() - validating  # nor is validation
            if step == first_step:  # it may have compiled or loaded: init_timeout_seconds covered it
                set_collective_timeout(runtime, cfg.comm.train_timeout_seconds)
            collector.step(step)
            c.profiler.step()
    if losses:
        c.metrics.log_summary(state)
    else:
        logger.info("training done: nothing left to train (resumed at step %d of %d)", state.step, training.steps)
    return losses


def check_skips(step: int, in_a_row: int, limit: int) -> None:
    """Stop a run whose every recent step was non-finite: skipping them all would only train on nothing."""
    if in_a_row >= limit:
        raise FloatingPointError(
            f"step {step}: {in_a_row} steps in a row had a non-finite gradient norm and were skipped "
            f"(training.max_consecutive_skipped_steps={limit}): training has diverged; lower optimizer.lr or "
            f"raise lr_scheduler.warmup_steps, and resume from an earlier checkpoint"
        )


def set_collective_timeout(runtime: Runtime, seconds: int) -> None:
    """Every mesh group's (and the world's) collective timeout becomes comm.train_timeout_seconds: after
    the first step a collective that long overdue is a hang, not a compile or a load (torchtitan's)."""
    from parallelisms.parallel_dims import FLATTENED

    mesh = runtime.world_mesh
    groups = [None, *mesh.get_all_groups()]
    for name in FLATTENED:
        try:
            groups.append(mesh[name].get_group())
        except (KeyError, ValueError):  # not registered: none of its dims is in this layout
            continue
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


# -------------------------------------------------------------------------------------- main
def run_job(cfg: JobConfig, device: torch.device, world_size: int) -> None:
    """Everything between joining the world and teardown; what it builds (the mesh, model,
    optimizer) is garbage once it returns."""
    warnings = check_config(cfg, world_size)  # the pre-flight's checks, on every rank (python -m trainer.train)
    parallel_dims = build_parallel_dims(cfg.parallelism, world_size)
    check_unsupported(cfg, device)
    for warning in warnings if dist.get_rank() == 0 else []:
        logger.warning("%s", warning)
    cfg.training.seed = resolve_seed(cfg.training.seed, device)
    set_determinism(cfg.training.deterministic)
    lock = lock_dump_folder(cfg.job.dump_folder)  # before writing anything there: one live job per folder
    try:
        # written only once the config is known good: a failed start leaves the last run's config alone
        logger.log(logging.INFO if cfg.job.print_config else logging.DEBUG, "resolved config:\n%s", to_toml(cfg))
        if dist.get_rank() == 0:
            logger.info("%s; resolved config saved to %s", cfg.job.description, save_config(cfg, cfg.job.dump_folder))
        train(cfg, Runtime(parallel_dims, parallel_dims.build_mesh(device.type), device))
    finally:
        lock.release()


def resolve_seed(seed: int | None, device: torch.device) -> int:
    """training.seed, or for None one drawn on rank 0 and shared: every rank must initialize alike."""
    if seed is not None:
        return seed
    drawn = torch.tensor(int.from_bytes(os.urandom(4), "little"), dtype=torch.int64, device=device)
    dist.broadcast(drawn, src=0)
    logger.info("training.seed is None: drew seed %d (saved in the resolved config)", int(drawn))
    return int(drawn)


def set_determinism(deterministic: bool) -> None:
    """training.deterministic: only deterministic kernels (an op without one raises), as torchtitan."""
    if not deterministic:
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's requirement for determinism


def teardown(device: torch.device, *, owns_group: bool) -> None:
    """Release the job's distributed state while the interpreter is still whole.

    A gloo worker thread frees each finished collective's tensors, which takes the GIL; a group that
    is only destroyed during interpreter finalization can have a worker do that after the GIL is
    gone, and the process aborts ("terminate called without an active exception"). So, in order:
    finish device work, collect the model/optimizer/DTensor cycles, then destroy the groups (meshes
    hold them weakly, so this frees them and joins gloo's workers here).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gc.collect()
    if not owns_group:  # a caller's world (e.g. a test's): theirs to destroy
        return
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if world() is not None:
        logger.warning(
            "the default process group is still referenced after destroy_process_group(), so it is freed at "
            "interpreter exit, where gloo can abort the process; hold process groups weakly (as DeviceMesh does)"
        )


@record  # torchrun's error file for errors before the world exists (after it, report_failure writes it)
def main(argv: list[str] | None = None) -> int:
    from .failure import claim_agent_died
    from .lifeline import watch_agent
    from .nodes import locate_rank_zero

    watch_agent(on_lost=claim_agent_died)  # first: an orphan (its agent killed) must stop, even mid-rendezvous
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    device = build_device()
    owns_group = init_distributed(device, cfg.comm)
    setup_logging(dist.get_rank())
    reports = owns_group and under_torchelastic()
    # where rank 0 runs (the c10d rendezvous ignores NODE_RANK): logged on every node, and named in reports
    rank_zero = locate_rank_zero(dist.distributed_c10d._get_default_store(), dist.get_rank()) if reports else None
    try:
        run_job(cfg, device, dist.get_world_size())
    except Exception as error:
        if reports:
            report_failure(error, rank_zero)  # once per job, by the first rank that failed; exits
        raise
    finally:
        teardown(device, owns_group=owns_group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
