"""Pre-flight: reject a bad configuration before any rank starts, naming the key and the fix.

`./run_train.sh` runs `python -m trainer.preflight <its args>` before torchrun: it parses the config
(unknown keys and types fail in config.py, with a did-you-mean), checks values and the degree
arithmetic against the world that torchrun will start (NGPU x NNODES), and exits 1 with the error
on the last line. The trainer runs the same checks (`check_config`) on every rank. Degrees are
checked by ParallelDims and the accumulation split by data_files.accumulation_steps, the same code
the ranks run. Both, and the model flavors, are torch-free, so the default job's pre-flight imports
no torch and takes a quarter of a second (torch alone takes about three on 2 CPU cores); only
checks of optional features (profiling, compile, checkpoints) import what they check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .config import JobConfig, Parallelism, did_you_mean, load_config
from .config.pipeline_checks import check_pipeline
from .config.state_floor import available_host_memory, check_host_memory, runs_on_cpu

if TYPE_CHECKING:  # the pre-flight runs before torch is imported
    from parallelisms.parallel_dims import ParallelDims

    from .config.pipeline_setup import PipelineSetup

# (key, check, what it must be) for values that have a valid range
_RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("training.steps", lambda v: v >= 1, ">= 1"),
    ("training.local_batch_size", lambda v: v >= 1, ">= 1"),
    ("training.seq_len", lambda v: v >= 1, ">= 1"),
    ("training.global_batch_size", lambda v: v == -1 or v >= 1, "-1 (local x dp) or >= 1"),
    ("model.vocab_size", lambda v: v >= 0, ">= 0 (0: the tokenizer's)"),
    ("optimizer.lr", lambda v: v >= 0, ">= 0"),
    ("optimizer.eps", lambda v: v > 0, "> 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("metrics.log_freq", lambda v: v >= 1, ">= 1"),
    ("metrics.peak_tflops", lambda v: v >= 0, ">= 0 (0: from the GPU's name)"),
    ("comm.init_timeout_seconds", lambda v: v > 0, "> 0"),
    ("comm.train_timeout_seconds", lambda v: v > 0, "> 0"),
    ("training.gc_freq", lambda v: v >= 1, ">= 1"),
    ("training.max_consecutive_skipped_steps", lambda v: v >= 1, ">= 1"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("lr_scheduler.decay_ratio", lambda v: v is None or 0 <= v <= 1, "None or in [0, 1]"),
    ("checkpoint.interval", lambda v: v >= 1, ">= 1"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("checkpoint.load_step", lambda v: v >= -1, "-1 (the latest) or a saved step"),
    ("validation.freq", lambda v: v >= 1, ">= 1"),
    ("validation.steps", lambda v: v == -1 or v >= 1, "-1 (the whole held-out set) or >= 1"),
    ("validation.local_batch_size", lambda v: v >= 0, ">= 0 (0: training.local_batch_size)"),
    ("validation.seq_len", lambda v: v >= 0, ">= 0 (0: training.seq_len)"),
    ("profiling.profile_freq", lambda v: v >= 1, ">= 1"),
    ("profiling.profiler_warmup", lambda v: v >= 0, ">= 0"),
    ("profiling.profiler_active", lambda v: v >= 1, ">= 1"),
    ("parallelism.pipeline_parallel_layers_per_stage", lambda v: v is None or v >= 1, "unset (None) or >= 1"),
]
# torch.compile's backends in torch 2.13 (`torch._dynamo.list_backends(exclude_tags=())`): a name outside them is
# looked up in torch itself (a plugin's), and refused only when torch does not know it either
COMPILE_BACKENDS = (
    "aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner", "aot_ts", "cudagraphs", "eager",
    "eager_debug", "inductor", "openxla", "pre_dispatch_eager", "ts", "tvm",
)  # fmt: skip
_CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


def check_config(cfg: JobConfig, world_size: int | None = None, *, local_files: bool = True) -> list[str]:
    """Raise ValueError naming the first bad key: value ranges, keys set to what needs a feature that is
    not here, paths that cannot be written, divisibility by tp and, given the world size, the degree
    arithmetic and the global batch split. Returns the warnings (e.g. a warmup longer than the run).
    `local_files=False` (the dry run, planned away from the cluster): the tokenizer and data files need not
    be here when model.vocab_size says the vocabulary."""
    for key, ok, want in _RANGES:
        value = _get(cfg, key)
        if not ok(value):
            raise ValueError(f"{key}={value!r}: must be {want}")
    check_names(cfg)
    _check_compile_backend(cfg)
    _check_unavailable(cfg)
    _check_converters(cfg)
    _check_paths(cfg)
    if world_size is not None:  # the degree arithmetic and the accumulation split, where they live
        from .config.data_files import accumulation_steps

        dims = build_parallel_dims(cfg.parallelism, world_size)
        if cfg.training.global_batch_size != -1:
            accumulation_steps(
                cfg.training.global_batch_size, cfg.training.local_batch_size, dims.dp_replicate * dims.dp_shard
            )
    _check_tp_divides_model(cfg)
    pipeline = check_pipeline(cfg)
    warnings = _schedule_warnings(cfg) + _feature_warnings(cfg, pipeline) + _float8_warnings(cfg)
    warnings += _profiling_warnings(cfg)
    _check_data(cfg, local_files=local_files)
    _check_checkpoint(cfg)
    _check_validation(cfg)
    if cfg.profiling.enable_profiling:
        from .profiling import check_profiling

        check_profiling(cfg.profiling)
    return warnings


def _get(cfg: JobConfig, key: str) -> Any:
    obj: Any = cfg
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def _schedule_warnings(cfg: JobConfig) -> list[str]:
    from .lr_schedule import plan_schedule  # torch-free

    sched = cfg.lr_scheduler
    return plan_schedule(
        warmup_steps=sched.warmup_steps, total_steps=cfg.training.steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    )[1]  # fmt: skip


def _feature_warnings(cfg: JobConfig, pipeline: PipelineSetup | None) -> list[str]:
    """Keys whose effect is only speed, set where they cannot act: the job runs, and says so."""
    p, warnings = cfg.parallelism, []
    if pipeline is not None:
        stages, m = pipeline.num_stages, pipeline.microbatches
        if m < stages:
            warnings.append(
                f"{m} pipeline microbatches (training.local_batch_size / "
                f"parallelism.pipeline_parallel_microbatch_size) for {stages} stages: the pipeline never fills, "
                f"its bubble is (stages - 1) / (m + stages - 1) = {(stages - 1) / (m + stages - 1):.0%}; raise the "
                f"local batch or lower the microbatch size"
            )
    if p.enable_async_tensor_parallel and p.tensor_parallel_degree == 1:
        warnings.append(
            "parallelism.enable_async_tensor_parallel=true has no effect: tensor_parallel_degree is 1 (no TP "
            "collectives to overlap)"
        )
    elif p.enable_async_tensor_parallel and "float8" in cfg.model.converters:
        warnings.append(
            "parallelism.enable_async_tensor_parallel=true: the float8 linears run their TP collectives "
            "synchronously (the collective matmul is built for high-precision linears only)"
        )
    return warnings


# (key, is it set to something needing what is not here, why and the fix)
_UNAVAILABLE: list[tuple[str, Callable[[Any], bool], str]] = [
    ("job.custom_config_module", bool, "meshtrain has no config extension modules; remove it"),
    ("experimental.custom_import", bool, "meshtrain has no model registry to extend; remove it"),
    ("experimental.custom_args_module", bool, "meshtrain has no config extension modules; remove it"),
    ("metrics.enable_wandb", bool, "Weights & Biases is not available here; use metrics.enable_tensorboard=true"),
    ("fault_tolerance.enable", bool, "torchft is not available here; use MAX_RESTARTS=N with checkpoint.enable"),
    ("memory_estimation.enable", bool, "the dry run is its own command: ./run_train.sh --estimate (python -m "
     "trainer.estimate); set it to false"),
    ("optimizer.early_step_in_backward", bool, "the optimizer steps after the backward only; set it to false"),
    ("training.enable_cpu_offload", bool, "FSDP CPU offload is not implemented; set it to false"),
    ("parallelism.enable_compiled_autograd", bool, "compiled autograd is not supported; set it to false"),
    ("checkpoint.initial_load_in_hf_quantized", bool, "quantized HF weights cannot be loaded; set it to false"),
    ("activation_checkpoint.visualize_memory_budget_pareto", bool, "the partitioner's pareto plot is not "
     "drawn here; set it to false"),
]  # fmt: skip


def build_parallel_dims(p: Parallelism, world_size: int) -> ParallelDims:
    """The config's degrees on `world_size` ranks (ValueError naming the arithmetic when they do not fit)."""
    from parallelisms.parallel_dims import ParallelDims

    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        world_size=world_size, ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
    )  # fmt: skip


def check_names(cfg: JobConfig) -> None:
    """The model, its flavor and the optimizer the config names exist here (before, a typo in a flavor
    launched every rank only for each to fail building the model)."""
    from models.registry import flavor_args, n_moe_layers  # dataclasses only, no torch

    args = flavor_args(cfg.model.name, cfg.model.flavor)
    if cfg.training.debug_moe_force_load_balance and not n_moe_layers(args):
        raise ValueError(
            f"training.debug_moe_force_load_balance=true: the {cfg.model.name} {cfg.model.flavor} flavor has no MoE "
            f"layers; set it to false"
        )
    if cfg.optimizer.name != "AdamW":
        raise ValueError(f"optimizer.name={cfg.optimizer.name!r}: only 'AdamW' is available")


def _check_unavailable(cfg: JobConfig) -> None:
    """torchtitan keys of features not here are accepted at their defaults; set otherwise they are refused."""
    for key, needs_it, why in _UNAVAILABLE:
        value = _get(cfg, key)
        if needs_it(value):
            raise ValueError(f"{key}={value!r}: {why}")
    from parallelisms.pipeline_parallel import get_schedule  # pure Python: no torch

    p = cfg.parallelism
    try:
        get_schedule(p.pipeline_parallel_schedule)
    except ValueError as e:
        raise ValueError(f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule!r}: {e}") from None
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget" and not (cfg.compile.enable and "model" in cfg.compile.components):
        raise ValueError(
            "activation_checkpoint.mode='memory_budget' needs the blocks compiled (torch.compile's min-cut "
            'partitioner chooses what they save): set compile.enable=true with "model" in compile.components'
        )
    if ac.mode == "memory_budget" and not 0.0 <= ac.memory_budget <= 1.0:
        raise ValueError(
            f"activation_checkpoint.memory_budget={ac.memory_budget}: expected a fraction in [0, 1] (0 recomputes "
            f"everything, 1 saves everything)"
        )
    option = ac.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ValueError(
            f"activation_checkpoint.selective_ac_option={option!r}: expected 'op' (op-level selective "
            f"checkpointing) or a positive int N (checkpoint every N-th block)"
        )


def _profiling_warnings(cfg: JobConfig) -> list[str]:
    """Profiling that can never record: its first window ends at step profiling.profile_freq."""
    prof, steps = cfg.profiling, cfg.training.steps
    if prof.enable_profiling and prof.profile_freq > steps:
        return [
            f"profiling.profile_freq({prof.profile_freq}) > training.steps({steps}): the first trace window ends at "
            f"step {prof.profile_freq}, so this run records no trace; lower profiling.profile_freq"
        ]
    return []


def _check_compile_backend(cfg: JobConfig) -> None:
    """A compile.backend torch knows, checked before launch (torch's InvalidBackend would come from every rank)."""
    backend = cfg.compile.backend
    if not cfg.compile.enable or backend in COMPILE_BACKENDS:
        return
    from torch._dynamo import list_backends  # only for a name outside torch's own: a plugin's, or a typo

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"compile.backend={backend!r} is not a torch.compile backend{did_you_mean(backend, known)}; "
            f"use 'inductor' (generated kernels) or 'aot_eager' / 'eager' (tracing only)"
        )


def _float8_warnings(cfg: JobConfig) -> list[str]:
    """torchtitan's FSDP float8 keys, set where they cannot act: the job runs, and says so."""
    f8, dims, key = cfg.quantize.linear.float8, cfg.parallelism, "quantize.linear.float8"
    gather, precompute = f8.enable_fsdp_float8_all_gather, f8.precompute_float8_dynamic_scale_for_fsdp
    if not cfg.model.converters or not (gather or precompute):
        return []
    if not gather:
        return [
            f"{key}.precompute_float8_dynamic_scale_for_fsdp has no effect without {key}.enable_fsdp_float8_all_gather"
            " (there are no float8 all-gathers to precompute scales for)"
        ]
    if dims.data_parallel_shard_degree == 1:
        return [f"{key}.enable_fsdp_float8_all_gather has no effect: data_parallel_shard_degree is 1 (no FSDP)"]
    return []


FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")  # torchtitan v0.2's name and its later one


def _check_converters(cfg: JobConfig) -> None:
    """model.converters: float8 (models.float8: tensorwise or torchao's rowwise recipes) converts; MX is
    not built, and the float8 all-gather takes tensorwise scales only (torchao's rule)."""
    for name in cfg.model.converters:
        if name in ("mx", "quantize.linear.mx"):
            raise ValueError(
                f"model.converters={cfg.model.converters}: MX (mxfp8) training is not implemented; use "
                f"model.converters=['float8'] (tensorwise float8) or []"
            )
        if name not in FLOAT8_CONVERTERS:
            raise ValueError(f"model.converters={cfg.model.converters}: unknown converter {name!r}; expected 'float8'")
    f8 = cfg.quantize.linear.float8
    if cfg.model.converters and f8.recipe_name not in (None, "tensorwise") and f8.enable_fsdp_float8_all_gather:
        raise ValueError(
            f"quantize.linear.float8.recipe_name={f8.recipe_name!r} with "
            f"quantize.linear.float8.enable_fsdp_float8_all_gather: FSDP gathers float8 weights with one scale per "
            f"tensor, which a rowwise recipe does not use (torchao's rule); set enable_fsdp_float8_all_gather "
            f"to false, or recipe_name to 'tensorwise'"
        )


def _check_paths(cfg: JobConfig) -> None:
    """The folders the job writes can be created and written, checked now rather than at the first save."""
    from pathlib import Path

    dump = Path(cfg.job.dump_folder)
    folders = [("job.dump_folder", dump), ("job.dump_folder", dump / "logs")]  # logs: every rank's output (launch)
    if cfg.checkpoint.enable and not cfg.checkpoint.load_only:
        folders.append(("checkpoint.folder", dump / cfg.checkpoint.folder))
    if cfg.profiling.enable_profiling:
        folders.append(("profiling.save_traces_folder", dump / cfg.profiling.save_traces_folder))
    if cfg.profiling.enable_memory_snapshot:
        folders.append(("profiling.save_memory_snapshot_folder", dump / cfg.profiling.save_memory_snapshot_folder))
    if cfg.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", dump / cfg.metrics.save_tb_folder))
    for key, folder in folders:
        problem = _unwritable(folder)
        if problem:
            raise ValueError(f"{key}={str(_get(cfg, key))!r}: {problem}; point {key} at a folder you can write")


def _unwritable(folder: Any) -> str | None:
    """Why `folder` cannot be created or written, or None: the nearest existing path must be a writable folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is an existing file" if existing == folder else f"cannot be created: {existing} is a file"
        return f"{folder} {what}, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{folder} cannot be {'written' if existing == folder else 'created'}: {existing} is not writable"
    return None


def _check_validation(cfg: JobConfig) -> None:
    """Validation sequences fit the model and the TP split, and its data is held out: local files other
    than the training files, or the embedded held-out corpus (a hub set would be read from "train")."""
    val, training = cfg.validation, cfg.training
    if not val.enable:
        return
    seq_len = val.seq_len or training.seq_len
    if seq_len > training.seq_len:
        raise ValueError(
            f"validation.seq_len({val.seq_len}) must be <= training.seq_len({training.seq_len}), the model's "
            f"max_seq_len (its RoPE table); lower it, or 0 for training.seq_len"
        )
    _check_sequence_split("validation.seq_len", seq_len, cfg)
    if not val.dataset_path:
        if val.dataset != "embedded":
            raise ValueError(
                f"validation.dataset={val.dataset!r}: hub datasets are not read for validation (the loader reads "
                f"their split 'train', the training data); set validation.dataset_path to local held-out files, "
                f"or validation.dataset='embedded'"
            )
        return
    from .config.data_files import dataset_files, resolve_data_files

    try:
        files = {p.resolve() for p in resolve_data_files(val.dataset_path)[1]}
    except ValueError as e:  # data.py names the training key
        raise ValueError(str(e).replace("training.dataset_path", "validation.dataset_path")) from None
    if training.dataset_path and files & {p.resolve() for p in dataset_files(training.dataset_path)}:
        raise ValueError(
            f"validation.dataset_path={val.dataset_path!r} shares files with training.dataset_path="
            f"{training.dataset_path!r}: a validation loss on training data is not held out; point it at other files"
        )


def _check_checkpoint(cfg: JobConfig) -> None:
    """exclude_from_loading names states the trainer saves; initial_load_path is a committed checkpoint."""
    ckpt = cfg.checkpoint
    unknown = [name for name in ckpt.exclude_from_loading if name not in _CHECKPOINT_STATES]
    if unknown:
        raise ValueError(f"checkpoint.exclude_from_loading={ckpt.exclude_from_loading}: {unknown} are not saved "
                         f"states; choose from {list(_CHECKPOINT_STATES)}")  # fmt: skip
    if ckpt.initial_load_path and not ckpt.initial_load_in_hf:  # loaded whether or not saving is enabled
        from pathlib import Path

        path, key = Path(ckpt.initial_load_path), f"checkpoint.initial_load_path={ckpt.initial_load_path!r}"
        if (path / "index.json").is_file():
            return
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            raise ValueError(f"{key} is a Hugging Face model folder, not a meshtrain checkpoint; set "
                             f"checkpoint.initial_load_in_hf=true to load it")  # fmt: skip
        raise ValueError(
            f"{key} is not a committed checkpoint (no index.json); point it at a step-<N> directory or at "
            f"`python -m checkpoint.convert from-hf` output"
        )


def _check_data(cfg: JobConfig, *, local_files: bool = True) -> None:
    """The tokenizer loads, model.vocab_size covers it and tp divides the vocabulary (each TP rank
    holds an equal slice of the embedding and output), and dataset_path names data files."""
    from .tokenizer import build_model_tokenizer, model_vocab_size  # the tokenizers package only with a path

    if local_files or cfg.model.vocab_size <= 0:
        tokenizer = build_model_tokenizer(cfg.model.tokenizer_path, cfg.model.hf_assets_path)
        vocab = model_vocab_size(tokenizer, cfg.model.vocab_size)
    else:
        vocab = cfg.model.vocab_size
    tp = cfg.parallelism.tensor_parallel_degree
    if vocab % tp:
        padded = -(-vocab // tp) * tp
        raise ValueError(
            f"the model's vocabulary({vocab}) must be divisible by parallelism.tensor_parallel_degree({tp}); "
            f"set model.vocab_size={padded} (pads the embedding and output)"
        )
    from .config.data_files import check_dataset_mix

    check_dataset_mix(cfg.training.dataset_path, cfg.training.dataset_weights, files=local_files)


def _check_tp_divides_model(cfg: JobConfig) -> None:
    from models.registry import flavor_args, tensor_parallel_dims  # dataclasses only, no torch

    p = cfg.parallelism
    tp = p.tensor_parallel_degree
    args = flavor_args(cfg.model.name, cfg.model.flavor)
    _check_ep_fits_model(cfg, args)
    for what, (n, why) in tensor_parallel_dims(args).items():
        if what == "moe_inter_dim" and p.expert_parallel_degree > 1 and p.expert_tensor_parallel_degree == 1:
            continue  # expert parallelism borrows the tp ranks: each holds whole experts
        if n % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree({tp}) must divide the {cfg.model.flavor} flavor's {what}({n}): "
                f"{why}; pick a divisor of {n}"
            )
    _check_sequence_split("training.seq_len", cfg.training.seq_len, cfg)


def _check_ep_fits_model(cfg: JobConfig, args: object) -> None:
    """Expert parallelism needs MoE layers, and experts that its ranks share out evenly."""
    from models.registry import moe_args_of  # dataclasses only, no torch

    ep = cfg.parallelism.expert_parallel_degree
    if ep == 1:
        return
    moe = moe_args_of(args)
    if moe is None:
        raise ValueError(
            f"parallelism.expert_parallel_degree({ep}): the {cfg.model.name} {cfg.model.flavor} flavor has no MoE "
            f"layers, so there are no experts to shard; set it to 1"
        )
    if moe.num_experts % ep:
        divisors = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
        raise ValueError(
            f"parallelism.expert_parallel_degree({ep}) must divide the {cfg.model.flavor} flavor's num_experts"
            f"({moe.num_experts}): each rank holds an equal share of the experts; pick one of {divisors}"
        )


def _check_sequence_split(key: str, seq_len: int, cfg: JobConfig) -> None:
    """Sequence parallelism cuts each sequence in tp pieces; context parallelism in 2 * cp chunks (two per
    rank, head and tail) and, within a rank, in tp again."""
    from parallelisms.parallel_dims import sequence_divisor  # torch-free

    p = cfg.parallelism
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    divisor = sequence_divisor(tp, cp)
    if cp > 1 and seq_len % divisor:
        raise ValueError(
            f"{key}({seq_len}) must be divisible by 2 x parallelism.context_parallel_degree({cp}) x "
            f"parallelism.tensor_parallel_degree({tp}) = {divisor}: context parallelism gives each rank two "
            f"chunks of 1/(2 x {cp}) of the sequence, which sequence parallelism cuts in {tp}; pick a multiple of "
            f"{divisor}"
        )
    if seq_len % tp:
        raise ValueError(
            f"{key}({seq_len}) must be divisible by parallelism.tensor_parallel_degree({tp}) (sequence "
            f"parallelism shards it); pick a multiple of {tp}"
        )


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        ranks_here = int(os.environ.get("NGPU", "1"))
        world = ranks_here * int(os.environ.get("NNODES", "1"))
        for warning in check_config(cfg, world):
            print(f"config warning: {warning}", file=sys.stderr)
        available = available_host_memory()
        if runs_on_cpu() and available is not None:  # GPU memory is the dry run's to check (--estimate)
            check_host_memory(cfg, build_parallel_dims(cfg.parallelism, world), ranks_here, available)
        log_rank = os.environ.get("LOG_RANK", "0")
        for r in log_rank.split(","):
            if r.strip() and not 0 <= int(r) < world:
                raise ValueError(
                    f"LOG_RANK={log_rank!r}: rank {r} does not exist in a world of {world}; use 0..{world - 1}"
                )
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
