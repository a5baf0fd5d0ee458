"""The builders the training loop and the dry run share: the model on meta (float8-converted), parallelized and
initialized, its optimizer and lr scheduler, and under pipeline parallelism this rank's parts with their stages
and schedule. `trainer.train` runs them for a job, `trainer.estimate.trace` on fake tensors."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from models.common.decoder import Decoder
from models.float8 import convert_to_float8_training
from models.registry import job_model_args, model_family
from parallelisms.dtensor.layout_invariant_init import layout_invariant_init
from parallelisms.fsdp import MixedPrecisionPolicy, precompute_all_gather_scales

from .config import JobConfig
from .lr_schedule import build_lr_scheduler
from .optim import build_optimizer
from .pipeline_training import Pipeline, PipelineParts, build_stages, build_tie_group, split_for_rank
from .preflight import FLOAT8_CONVERTERS
from .runtime import Runtime

logger = logging.getLogger(__name__)


def build_model(
    cfg: JobConfig, vocab_size: int, *, eos_id: int | None = None, n_layers: int | None = None, causal: bool = False
) -> Decoder:
    """The family's model of the flavor on the meta device (no memory; `init_model` allocates the shards
    after parallelization), its vocabulary the tokenizer's, its end-of-document token `eos_id` (the tokenizer's:
    block-causal masking) and max_seq_len seq_len; with `n_layers`, only its first blocks (the dry run's sampled
    traces); with `causal`, causal attention whatever the flavor's mask (the dry run: fake tokens hold no
    documents, and causal attention's FLOPs bound block-causal's)."""
    # the model's name and flavor: checked by check_config, as every entry point runs it first
    flavor_mask = getattr(model_family(cfg.model.name).flavor(cfg.model.flavor), "attn_mask_type", "causal")
    mask: dict[str, Any] = {}
    if causal and flavor_mask != "causal":
        mask = {"attn_mask_type": "causal"}
    elif flavor_mask == "block_causal" and eos_id is not None:  # a causal model's args stay the flavor's
        mask = {"eos_id": eos_id}
    args = job_model_args(cfg.model.name, cfg.model.flavor, vocab_size=vocab_size, max_seq_len=cfg.training.seq_len,
                          **mask)  # fmt: skip
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers, **_sampled_dense_layers(cfg, args, n_layers))
    if getattr(args, "moe_args", None) is not None:  # torchtitan's training.debug_moe_force_load_balance
        force = cfg.training.debug_moe_force_load_balance
        args = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, _debug_force_load_balance=force))
    with torch.device("meta"):
        model = model_family(cfg.model.name).parts.model_class(args)
    if any(name in FLOAT8_CONVERTERS for name in cfg.model.converters):  # before parallelizing, as torchtitan
        f8 = cfg.quantize.linear.float8
        converted = convert_to_float8_training(model, filter_fqns=f8.filter_fqns, emulate=f8.emulate,
                                               fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
                                               recipe_name=f8.recipe_name)  # fmt: skip
        kept = [n for n, m in model.named_modules() if type(m) is nn.Linear] or "none"
        logger.info("float8 (%s): %d linears converted; left in high precision: %s", f8.recipe_name or "tensorwise",
                    len(converted), kept)  # fmt: skip
        if cfg.model.print_after_conversion:
            logger.info("model after conversion:\n%s", model)
    return model


def _sampled_dense_layers(cfg: JobConfig, args: Any, n_layers: int) -> dict[str, int]:
    """DeepSeek's dense first blocks in a dry-run variant of `n_layers` blocks. Without PP the sampled counts start
    after them (trainer/estimate/sampling.py), so they stay. Under PP the variants hold k blocks per stage, which
    cannot keep them in place consistently: every block is then an MoE block, an upper bound for the first stage."""
    dense = getattr(args, "n_dense_layers", 0)
    if dense and (cfg.parallelism.pipeline_parallel_degree > 1 or dense >= n_layers):
        return {"n_dense_layers": 0}
    return {}


def init_model(model: Decoder, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and initialize them. Under one seed the global
    weights are bitwise the same on every layout and world size (layout_invariant_init), so no
    seed checkpoint is needed; no rank ever holds more than its shards."""
    model.to_empty(device=device)
    with layout_invariant_init():
        model.init_weights(buffer_device=device)


def build_job_optimizer(cfg: JobConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The config's optimizer over `model`, with torchtitan's post-step hook: under float8 all-gathers with
    `precompute_float8_dynamic_scale_for_fsdp`, every float8 weight's scale for the next step in one all-reduce."""
    opt = cfg.optimizer
    optimizer = build_optimizer(
        model, name=opt.name, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2),
        implementation=opt.implementation,
    )  # fmt: skip
    f8 = cfg.quantize.linear.float8
    if cfg.model.converters and f8.enable_fsdp_float8_all_gather and f8.precompute_float8_dynamic_scale_for_fsdp:
        parts = list(model.parts) if isinstance(model, PipelineParts) else [model]
        optimizer.register_step_post_hook(lambda *_: precompute_all_gather_scales(parts))  # type: ignore[arg-type]
    return optimizer


def build_model_and_optimizer(
    cfg: JobConfig, runtime: Runtime, vocab_size: int, *, eos_id: int | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, LambdaLR]:
    """The parallelized, initialized model, its optimizer and lr scheduler."""
    model = build_parallel_model(cfg, runtime, vocab_size, eos_id=eos_id)
    optimizer = build_job_optimizer(cfg, model)
    sched = cfg.lr_scheduler
    scheduler = build_lr_scheduler(
        optimizer, warmup_steps=sched.warmup_steps, total_steps=cfg.training.steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    )  # fmt: skip
    return model, optimizer, scheduler


def build_parallel_model(cfg: JobConfig, runtime: Runtime, vocab_size: int, *, eos_id: int | None = None) -> nn.Module:
    """The model parallelized (TP -> AC -> compile -> FSDP/DDP) and initialized; under pipeline parallelism
    this rank's parts (`PipelineParts`, with their `Pipeline`), each initialized from the whole model's
    random stream. One seed gives every layout the same global weights."""
    whole = build_model(cfg, vocab_size, eos_id=eos_id)
    pp = runtime.parallel_dims.pp_enabled
    parts, stage_ids = [whole], [0]
    if pp:
        pp_mesh = runtime.world_mesh["pp"]
        assert runtime.pipeline is not None, "build_runtime resolves the pipeline setup under PP"
        parts, stage_ids = split_for_rank(runtime.pipeline, whole, pp_mesh.get_local_rank())
    mp_policy = MixedPrecisionPolicy(param_dtype=runtime.precision.param, reduce_dtype=runtime.precision.reduce)
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    # torchtitan's "default": reshard after forward, except under PP (each microbatch would gather again)
    reshard = p.fsdp_reshard_after_forward == "always" or (p.fsdp_reshard_after_forward == "default" and not pp)
    parallelize = model_family(cfg.model.name).parts.parallelize
    for part in parts:
        parallelize(
            part, runtime.parallel_dims, runtime.world_mesh, loss_parallel=runtime.loss_parallel,
            ac_mode=ac.mode,
            ac_selective_option=ac.selective_ac_option, ac_early_stop=ac.early_stop, ac_memory_budget=ac.memory_budget,
            mp_policy=mp_policy,
            ac_force_recompute_mm_fqns=tuple(ac.per_op_sac_force_recompute_mm_shapes_by_fqns),
            reshard_after_forward=reshard,
            compile_backend=cfg.compile.backend if cfg.compile.enable and "model" in cfg.compile.components else None,
            cp_rotate_method=p.context_parallel_rotate_method, async_tp=p.enable_async_tensor_parallel,
        )  # fmt: skip
        # identical on every rank (run_job resolved a None seed): the init fills stay in step
        torch.manual_seed(cast(int, cfg.training.seed))
        init_model(part, runtime.device)
        to_training_dtype(part, cfg.training.dtype)
    return assemble_pipeline(cfg, runtime, whole, parts, stage_ids) if pp else whole


def assemble_pipeline(
    cfg: JobConfig, runtime: Runtime, whole: Decoder, parts: list[Decoder], stage_ids: list[int]
) -> PipelineParts:
    """This rank's parallelized, allocated parts as one model, with their stages and schedule (`.pipeline`)."""
    setup = runtime.pipeline
    assert setup is not None, "build_runtime resolves the pipeline setup under PP"
    model = PipelineParts(parts, whole)
    pp_mesh = runtime.world_mesh["pp"]
    bf16 = runtime.device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
    stages = build_stages(setup, parts, stage_ids, pp_mesh, runtime.device, torch.bfloat16 if bf16 else torch.float32)
    tied = whole.model_args.tie_word_embeddings
    tie_group = build_tie_group(runtime.world_mesh, tied, setup.schedule.placement)
    tie_ref = weakref.ref(tie_group) if tie_group is not None else None  # c10d keeps it until destroyed
    model.__dict__["pipeline"] = Pipeline(model, stages, setup.schedule, setup.microbatches, pp_mesh, tie_ref)
    return model


def to_training_dtype(model: nn.Module, dtype: str) -> None:
    """torchtitan's training.dtype "bfloat16": no float32 master weights at all. Floating tensors only:
    Module.to(dtype) also casts complex buffers, and RoPE's freqs_cis cast to a real dtype loses its imaginary
    part (every position's rotation would read as a scaling)."""
    if dtype == "bfloat16":
        model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
