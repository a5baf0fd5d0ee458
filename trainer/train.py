"""Training entry point: `python -m trainer.train --job.config_file FILE [--section.key value ...]`.

Owns the job's lifecycle: config, logging, the process group and mesh, the model and its
parallelization, and the loop (forward, cross-entropy, backward, clip, step). Only this module sees
the whole JobConfig; every `build_*` gets its own section or explicit arguments.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.lr_scheduler import LambdaLR

from checkpoint.manager import CheckpointManager
from checkpoint.stateful import ModelState, OptimizerState, RngState, Stateful
from models.hf_adapters import hf_adapter
from models.registry import flops_per_token
from parallelisms.dtensor.collectives import all_gather_object

from .build import build_model_and_optimizer
from .checkpointing import TRAINER_ROLES
from .config import Comm, JobConfig, load_config, save_config, to_toml
from .data import TokenBatches, build_data_loader
from .metrics import MetricsLogger
from .moe_balance import ExpertBalancer, register_expert_balancing
from .pipeline_training import (
    PipelineParts,
    pipeline_token_loss,
    pipeline_train_step,
)
from .preflight import build_parallel_dims, check_config
from .process.dump_folder import lock_dump_folder
from .process.failure import report_failure, under_torchelastic
from .process.garbage import GarbageCollection
from .process.log_prefix import rank_prefix
from .process.preemption import PreemptionWatch
from .profiling import Profiler
from .runtime import Runtime, build_runtime
from .step import (
    NonfiniteWatch,
    StepResult,
    fetch_micro_batches,
    global_target_count,
    reduce_loss,
    tokens_per_device,
    train_step,
)
from .token_loss import build_cross_entropy
from .tokenizer import Tokenizer, build_model_tokenizer, model_vocab_size
from .train_state import TrainState
from .validate import ScalarWriter, Validator, build_held_out_windows

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- setup
def setup_logging(rank: int) -> None:
    """`[rank0] time LEVEL module: msg` (the prefix written once: `process/log_prefix.py`); ranks not in LOG_RANK
    (default "0") only log warnings."""
    log_ranks = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip()}
    logging.basicConfig(
        level=logging.INFO if rank in log_ranks else logging.WARNING,
        format=rank_prefix(rank) + "%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def build_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU (gloo)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, comm: Comm, dump_folder: str = "./outputs") -> bool:
    """Join torchrun's world, or a 1-rank world when run without torchrun. Reuses an existing default
    process group (e.g. a test world). Returns whether this call created it (and so must destroy it)."""
    if dist.is_initialized():
        return False
    if device.type == "cuda" and comm.trace_buf_size > 0:  # NCCL's flight recorder, dumped on a timeout
        traces = Path(dump_folder) / comm.save_traces_folder
        traces.mkdir(parents=True, exist_ok=True)
        for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # torch's new name, then its old one
            os.environ.setdefault(name, str(comm.trace_buf_size))
        for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
            os.environ.setdefault(name, str(traces / comm.save_traces_file_prefix))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
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


def check_unsupported(cfg: JobConfig, device: torch.device) -> None:
    """Fail early, with the fix, on options whose support depends on the device (the pre-flight, which
    may run where the job does not, accepts them)."""
    emulate = cfg.quantize.linear.float8.emulate
    if cfg.model.converters and device.type == "cuda" and not emulate and torch.cuda.get_device_capability() < (8, 9):
        raise NotImplementedError(
            f"model.converters={cfg.model.converters}: float8 matmuls need CUDA compute capability 8.9 or newer "
            f"(H100, L4, B200), this GPU has {torch.cuda.get_device_capability()}; set "
            f"quantize.linear.float8.emulate=true (float32 matmuls of float8 values, for testing) or "
            f"model.converters=[]"
        )


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
    balancer: ExpertBalancer  # the MoE layers' load balancing; empty for a dense model

    def close(self) -> None:
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()  # an async save in flight is committed before the job ends
        finally:
            self.metrics.close()


def build_components(cfg: JobConfig, runtime: Runtime) -> Components:
    """Model, optimizer, scheduler, data, metrics and checkpointer, resumed from the latest
    checkpoint when there is one (`train_state.step` is then the step to continue after)."""
    training = cfg.training
    tokenizer = build_model_tokenizer(cfg.model.tokenizer_path, cfg.model.hf_assets_path)
    model, optimizer, scheduler = build_model_and_optimizer(
        cfg, runtime, model_vocab_size(tokenizer, cfg.model.vocab_size), eos_id=tokenizer.eos_id
    )
    # the mesh, not its group: a mesh holds its groups weakly, and the loader outlives destroy_process_group()
    dp_mesh = runtime.world_mesh["dp"] if runtime.dp_size > 1 else None

    def gather_state(state: dict[str, Any]) -> list[dict[str, Any]]:  # each dp rank knows only its rows' cursors
        assert dp_mesh is not None  # called only when dp > 1
        return cast(list[dict[str, Any]], all_gather_object(state, dp_mesh.get_group()))

    loader = build_data_loader(
        training.dataset, tokenizer, dataset_path=training.dataset_path, text_field=training.dataset_text_field,
        dataset_weights=training.dataset_weights, local_batch_size=training.local_batch_size, seq_len=training.seq_len,
        dp_rank=runtime.dp_rank, dp_size=runtime.dp_size, seed=training.seed, gather_state=gather_state,
        global_batch_size=training.global_batch_size if training.global_batch_size > 0 else None,
    )  # fmt: skip
    balancer = register_expert_balancing(model, optimizer, runtime.dp_cp_mesh)
    fpt = flops_per_token(cfg.model.name, model.model_args, training.seq_len)  # the whole model's, under PP too
    tb_folder = tensorboard_folder(cfg, dist.get_rank())
    metrics = MetricsLogger(
        flops_per_token=fpt, device=runtime.device, total_steps=training.steps, tb_folder=tb_folder,
        peak_tflops_override=cfg.metrics.peak_tflops, rank=dist.get_rank(), log_freq=cfg.metrics.log_freq,
    )  # fmt: skip
    train_state = TrainState()
    checkpointer = build_checkpointer(cfg, model, optimizer, scheduler, loader, train_state)
    validator = build_validator(cfg, runtime, tokenizer, writer=metrics.writer, model=model)
    profiler = Profiler(cfg.profiling, dump_folder=Path(cfg.job.dump_folder), rank=dist.get_rank(),
                        device=runtime.device, global_step=train_state.step)  # fmt: skip
    return Components(
        model, optimizer, scheduler, loader, train_state, metrics, checkpointer, validator, profiler, balancer
    )


def tensorboard_folder(cfg: JobConfig, rank: int) -> Path | None:
    """dump_folder/save_tb_folder on rank 0, or rank_<R> under it on every rank with save_for_all_ranks."""
    m = cfg.metrics
    if not m.enable_tensorboard or (rank != 0 and not m.save_for_all_ranks):
        return None
    folder = Path(cfg.job.dump_folder) / m.save_tb_folder
    return folder / f"rank_{rank}" if m.save_for_all_ranks else folder


def build_validator(
    cfg: JobConfig, runtime: Runtime, tokenizer: Tokenizer, *, writer: ScalarWriter | None, model: nn.Module
) -> Validator | None:
    """The held-out loss every validation.freq steps; its batch size and seq_len default to training's.
    Under PP the batches run the schedule's forwards (`pipeline_token_loss`)."""
    val, training = cfg.validation, cfg.training
    if not val.enable:
        return None
    token_loss = None
    if isinstance(model, PipelineParts):
        token_loss = pipeline_token_loss(model.pipeline, cfg.parallelism.pipeline_parallel_microbatch_size)
    source = build_held_out_windows(
        val.dataset, tokenizer, dataset_path=val.dataset_path, text_field=training.dataset_text_field,
        seq_len=val.seq_len or training.seq_len, seed=cast(int, training.seed),
    )  # fmt: skip
    return Validator(
        source, freq=val.freq, steps=val.steps, local_batch_size=val.local_batch_size or training.local_batch_size,
        last_step=training.steps, dp_rank=runtime.dp_rank, dp_size=runtime.dp_size, dp_mesh=runtime.dp_cp_mesh,
        use_loss_parallel=runtime.loss_parallel, device=runtime.device, writer=writer,
        autocast=runtime.precision.autocast, token_loss=token_loss, sequence=runtime.sequence,
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
        "model": ModelState(model, model.sync_tied_copy if isinstance(model, PipelineParts) else None),
        "optimizer": OptimizerState(model, optimizer), "lr_scheduler": scheduler,
        "dataloader": loader, "train_state": train_state, "rng": RngState(),
    }  # fmt: skip
    metadata = {"job_config": cfg.to_dict(), "model_args": dataclasses.asdict(cast(Any, model.model_args))}
    # the trainer's conventions (trainer/checkpointing.py): the weights under "model", a resume point holds
    # "train_state", and weights of a Llama with other architecture args are refused
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    manager = CheckpointManager(folder, states, metadata=metadata, roles=TRAINER_ROLES,
                                hf_adapter=hf_adapter(cfg.model.name), **options)  # fmt: skip
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
        training.local_batch_size, runtime.precision.summary(runtime.device, training.mixed_precision_reduce),
    )  # fmt: skip
    try:
        with c.profiler:
            return train_loop(cfg, runtime, c)
    finally:
        c.close()


def train_loop(cfg: JobConfig, runtime: Runtime, c: Components) -> list[float]:
    """Steps `c.train_state.step + 1 .. training.steps`: take the step, log it at the metrics' cadence, then each
    component's end of step (it decides its own cadence). Returns the logged losses."""
    training, state = cfg.training, c.train_state
    batches, first_step, run_step = iter(c.loader), state.step + 1, bind_train_step(cfg, runtime, c)
    nonfinite = NonfiniteWatch(runtime.device, skip=training.skip_nonfinite_steps,
                               max_consecutive_skips=training.max_consecutive_skipped_steps)  # fmt: skip
    if c.checkpointer is not None:
        c.checkpointer.add_pre_save_hook(nonfinite.check)  # never save weights a non-finite step spoilt
    c.metrics.begin(state)
    with (
        GarbageCollection(training.gc_freq, debug=training.gc_debug) as collector,
        PreemptionWatch(enabled=c.checkpointer is not None and c.checkpointer.saving) as preemption,
    ):
        for step in range(first_step, training.steps + 1):
            result, lr = take_step(step, batches, run_step, nonfinite, runtime, c)
            if c.metrics.should_log(step):
                nonfinite.check()  # the host waits here anyway
                loss = reduce_loss(result.loss, runtime.dp_cp_mesh)
                c.metrics.log_interval(step, loss=loss, grad_norm=float(result.grad_norm), lr=lr)
                if (load := c.balancer.last) is not None:
                    c.metrics.log_expert_load(step, load)
            end_of_step(c, step, last=step == training.steps, preemption=preemption)
            if step == first_step:  # it may have compiled or loaded: init_timeout_seconds covered it
                set_collective_timeout(runtime, cfg.comm.train_timeout_seconds)
            collector.step(step)
            c.profiler.step()
    nonfinite.check()
    if c.metrics.losses:
        c.metrics.log_summary(state)
    else:
        logger.info("training done: nothing left to train (resumed at step %d of %d)", state.step, training.steps)
    return c.metrics.losses


def take_step(
    step: int, batches: Iterator, run_step: Callable[[list, torch.Tensor], StepResult], nonfinite: NonfiniteWatch,
    runtime: Runtime, c: Components,
) -> tuple[StepResult, float]:  # fmt: skip
    """One optimizer step: fetch its micro-batches (timed as data time), take this rank's share of their tokens
    (under CP a share of each sequence), run the step, then advance the scheduler, the train state and the
    token count. Returns the step's result and the learning rate it ran at."""
    with c.metrics.timing_data():
        micro = fetch_micro_batches(batches, c.loader.accumulation_steps, runtime.device)
    lr = float(c.scheduler.get_last_lr()[0])
    local = runtime.shard_sequences(micro)
    result = run_step(local, global_target_count([y for _, y in local], runtime.dp_cp_mesh))
    nonfinite.observe(step, result)
    c.scheduler.step()
    c.train_state.advance(step, tokens=sum(x.numel() for x, _ in micro) * runtime.dp_size, skipped=result.skipped)
    c.metrics.count_step(tokens_per_device(micro, runtime.parallel_dims))
    return result, lr


def bind_train_step(cfg: JobConfig, runtime: Runtime, c: Components) -> Callable[[list, torch.Tensor], StepResult]:
    """`run_step(local_micro_batches, targets)`: the pipeline's step or `train_step`, with the config's
    constants bound once."""
    average, max_norm, loss_parallel = runtime.grad_average_size, cfg.training.max_norm, runtime.loss_parallel
    if isinstance(c.model, PipelineParts):
        pipeline = c.model.pipeline
        return lambda local, targets: pipeline_train_step(
            pipeline, c.optimizer, local, targets=targets, grad_average_size=average, max_norm=max_norm,
            use_loss_parallel=loss_parallel,
        )  # fmt: skip
    compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
    cross_entropy = build_cross_entropy(cfg.compile.backend if compile_loss else None)
    model, skip, autocast = c.model, cfg.training.skip_nonfinite_steps, runtime.precision.autocast
    return lambda local, targets: train_step(
        model, c.optimizer, local, targets=targets, grad_average_size=average, max_norm=max_norm,
        use_loss_parallel=loss_parallel, skip_nonfinite=skip, autocast=autocast, cross_entropy=cross_entropy,
    )  # fmt: skip


def end_of_step(c: Components, step: int, *, last: bool, preemption: PreemptionWatch) -> None:
    """The checkpointer and the validator at their cadence (outside tok/s), then a requested preemption:
    every rank stops at the same step, with this step saved."""
    with c.metrics.paused():  # not training: tok/s leaves these out
        saved = c.checkpointer is not None and c.checkpointer.save_if_due(step, last=last)
        if c.validator is not None:
            c.validator.validate_if_due(c.model, step)
    if preemption.requested():  # collective: every rank stops at the same step
        if not saved:
            c.checkpointer.save(step)  # type: ignore[union-attr]
        raise preemption.stop(step, saved=True)


def set_collective_timeout(runtime: Runtime, seconds: int) -> None:
    """Every mesh group's (and the world's) collective timeout becomes comm.train_timeout_seconds: after
    the first step a collective that long overdue is a hang, not a compile or a load (torchtitan's)."""
    from parallelisms.parallel_dims import FLATTENED

    mesh = runtime.world_mesh
    groups = [None, *mesh.get_all_groups()]
    for name in (*FLATTENED, "ep"):
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
        train(cfg, build_runtime(cfg, parallel_dims, parallel_dims.build_mesh(device.type), device))
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
    from .process.failure import claim_agent_died
    from .process.host_memory import keep_freed_host_memory
    from .process.lifeline import watch_agent
    from .process.nodes import locate_rank_zero

    watch_agent(on_lost=claim_agent_died)  # first: an orphan (its agent killed) must stop, even mid-rendezvous
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    device = build_device()
    if device.type == "cpu":  # the tensors live in malloc's memory; on a GPU the caching allocator keeps it
        keep_freed_host_memory()
    owns_group = init_distributed(device, cfg.comm, cfg.job.dump_folder)
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
