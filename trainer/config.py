"""JobConfig: the job's whole configuration, from dataclass defaults < TOML file < `--section.key value`.

Sections and keys follow torchtitan v0.2 so its TOML files port. Only `trainer/train.py` sees the
whole `JobConfig`; every component gets its own section or explicit arguments.
Unknown sections or keys fail with a did-you-mean; values are parsed from the fields' types.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass(kw_only=True)
class Job:
    config_file: str | None = None
    """TOML file the job was configured from (None: dataclass defaults and CLI only)."""
    dump_folder: str = "./outputs"
    """Folder for everything the job writes: the resolved config, tensorboard logs, checkpoints."""
    description: str = "meshtrain job"
    """Free-text description, logged at start."""


@dataclass(kw_only=True)
class Model:
    name: str = "llama3"
    """Model family; only "llama3" exists."""
    flavor: str = "debugmodel"
    """Key into the family's flavors (models.llama3.llama3_configs)."""
    tokenizer_path: str = ""
    """A Hugging Face tokenizer.json, or a folder holding one (BOS/EOS from tokenizer_config.json next to it,
    else from its special tokens); "" is the byte tokenizer (vocab 258)."""
    vocab_size: int = 0
    """The model's vocabulary; 0 is the tokenizer's. Larger pads the embedding and output (e.g. 2048 for the
    debugmodel's 2000-token tokenizer, or a multiple of the TP degree); smaller is an error."""


@dataclass(kw_only=True)
class Optimizer:
    name: str = "AdamW"
    """Optimizer; only "AdamW" (foreach) exists."""
    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW)."""


@dataclass(kw_only=True)
class LRScheduler:
    warmup_steps: int = 2
    """Steps of linear warmup from ~0 to optimizer.lr."""
    decay_type: Literal["linear", "cosine"] = "linear"
    """Shape of the decay from optimizer.lr to min_lr_factor * lr after warmup."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass(kw_only=True)
class Training:
    local_batch_size: int = 2
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1: local_batch_size x dp degree.
    A multiple of that accumulates gradients over global / (local x dp) micro-batches."""
    seq_len: int = 256
    """Tokens per sequence (also the model's max_seq_len)."""
    steps: int = 10
    """Optimizer steps to train."""
    max_norm: float = 1.0
    """Clip the global gradient 2-norm to this (<= 0 disables clipping, still logs the norm)."""
    seed: int = 0
    """Seed for weights and data order; identical on every rank."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """On CUDA, the dtype parameters compute in: FSDP all-gathers them in it; without FSDP the forward
    runs under torch.autocast. The CPU always trains in float32 (logged at start)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """On CUDA, the dtype of FSDP's gradient reduce-scatter."""
    skip_nonfinite_steps: bool = False
    """On a NaN/inf loss or gradient norm, skip that optimizer step (counted) instead of stopping."""
    dataset: str = "embedded"
    """Dataset: "embedded" (the corpus shipped in trainer/corpus/, no network) or a Hugging Face hub dataset name
    (split "train", streamed); with dataset_path set it only names the data."""
    dataset_path: str = ""
    """Local data instead: a file, folder or glob of .txt (each blank-line-separated paragraph a document),
    .json/.jsonl (JSON lines) or .parquet files, streamed in path order and tokenized on the fly."""
    dataset_text_field: str = "text"
    """The field holding a document's text in JSON / parquet / hub rows."""


@dataclass(kw_only=True)
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicated data parallelism (HSDP outer dim)."""
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 takes whatever the other degrees leave of the world size."""
    tensor_parallel_degree: int = 1
    """Tensor + sequence parallelism degree."""
    context_parallel_degree: int = 1
    """Context parallelism degree (not supported by the llama3 plan yet)."""
    pipeline_parallel_degree: int = 1
    """Pipeline parallelism degree (not supported yet)."""
    enable_loss_parallel: bool = True
    """With TP, keep logits sharded on the vocabulary dim for the cross-entropy."""


@dataclass(kw_only=True)
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing of transformer blocks: none, full or selective."""


@dataclass(kw_only=True)
class Metrics:
    log_freq: int = 1
    """Log the metrics line every this many steps (and at the last step)."""
    enable_tensorboard: bool = False
    """Also write the metrics to tensorboard under dump_folder/tb."""
    peak_tflops: float = 0.0
    """Peak dense TFLOPS of one device for MFU (0: from the bf16 table by GPU name; on CPU MFU is n/a unless set)."""


@dataclass(kw_only=True)
class Checkpoint:
    enable: bool = False
    """Save checkpoints, and resume from the latest committed one in `folder` on start."""
    folder: str = "checkpoint"
    """Where checkpoints go, under job.dump_folder: one committed `step-<N>/` per save."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep only the newest k committed checkpoints (0: keep all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """"async": stage to CPU memory and write on a background thread (the loop waits only for the copy)."""
    last_save_model_only: bool = True
    """The save at the last step holds only the model (in export_dtype): a smaller export, not a resume point."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the model in a model-only last save."""
    initial_load_path: str = ""
    """With no checkpoint in `folder` yet, start from this checkpoint directory (e.g. made by `from-hf`)."""
    initial_load_model_only: bool = True
    """From initial_load_path load only the model (not the optimizer, data position, ...)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Top-level states not to resume (e.g. ["dataloader", "optimizer"])."""
    load_step: int = -1
    """Resume from this step's checkpoint instead of the latest (-1: latest)."""


@dataclass(kw_only=True)
class Compile:
    enable: bool = False
    """torch.compile each transformer block (FSDP / HSDP / one process; not with tensor parallelism)."""
    backend: str = "inductor"
    """torch.compile backend: "inductor" (generated kernels), or "aot_eager" / "eager" to check tracing cheaply."""


@dataclass(kw_only=True)
class Validation:
    enable: bool = False
    """Compute the loss on held-out data every `freq` steps (and at the last step), without gradients."""
    freq: int = 10
    """Validate every this many steps."""
    steps: int = -1
    """Validation batches per evaluation (each local_batch_size x dp sequences); -1: the whole held-out set once."""
    dataset: str = "embedded"
    """"embedded": trainer/corpus/validation.txt, documents held out of the training corpus. Hub datasets are not
    read for validation (the loader reads split "train"); use dataset_path."""
    dataset_path: str = ""
    """Local held-out files (.txt, .json/.jsonl, .parquet: as training.dataset_path), read once per evaluation."""
    local_batch_size: int = 0
    """Sequences per data-parallel rank per validation batch; 0: training.local_batch_size."""
    seq_len: int = 0
    """Tokens per validation sequence, at most training.seq_len (the model's max_seq_len); 0: training.seq_len."""


@dataclass(kw_only=True)
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (Chrome JSON, one per rank) of a window of steps every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Under job.dump_folder: iteration_<N>/rank<R>_trace.json for the window ending at step N."""
    profile_freq: int = 10
    """Trace a window every this many steps: wait profile_freq - warmup - active steps, warm up, then record."""
    profiler_warmup: int = 3
    """Steps the profiler runs without recording before each window (its own start-up costs stay out)."""
    profiler_active: int = 1
    """Steps recorded in each window."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps (and on OOM), for
    pytorch.org/memory_viz; on CPU it is skipped with a warning."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Under job.dump_folder: iteration_<N>/rank<R>_memory_snapshot.pickle."""


@dataclass(kw_only=True)
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of process-group initialization and collectives."""


@dataclass(kw_only=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    compile: Compile = field(default_factory=Compile)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------ parsing
def _did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _section_fields(cfg: JobConfig, section: str, where: str) -> dict[str, dataclasses.Field]:
    names = {f.name for f in dataclasses.fields(cfg)}
    if section not in names:
        raise ValueError(f"unknown config section [{section}] in {where}{_did_you_mean(section, names)}")
    return {f.name: f for f in dataclasses.fields(getattr(cfg, section))}


def _field_type(section_obj: Any, key: str) -> Any:
    return typing.get_type_hints(type(section_obj))[key]


def parse_value(raw: Any, tp: Any, name: str) -> Any:
    """Convert `raw` (a CLI string or a TOML value) to the field type `tp`; errors name the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        return parse_value(raw, args[0], name)
    if origin is list:  # a TOML array, or a comma-separated CLI string
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list):
            raise TypeError(f"{name}={raw!r}: expected a list (TOML array or comma-separated)")
        return [parse_value(item.strip() if isinstance(item, str) else item, typing.get_args(tp)[0], name)
                for item in items if item != ""]  # fmt: skip
    if origin is Literal:
        choices = typing.get_args(tp)
        if raw not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {list(choices)}")
        return raw
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
            return raw.lower() in ("true", "1")
        raise TypeError(f"{name}={raw!r}: expected a bool (true or false)")
    if tp in (int, float):
        # bool is an int subclass and 1.5 is not an int: both are typos of the number meant
        wrong = isinstance(raw, bool) or (tp is int and isinstance(raw, float))
        try:
            if not wrong:
                return tp(raw)
        except ValueError:
            pass
        raise TypeError(f"{name}={raw!r}: expected {'an int' if tp is int else 'a float'}")
    if tp is str:
        if not isinstance(raw, str):
            raise TypeError(f"{name}={raw!r}: expected a string")
        return raw
    raise TypeError(f"{name}: unsupported field type {tp}")


def _set(cfg: JobConfig, section: str, key: str, raw: Any, where: str) -> None:
    fields = _section_fields(cfg, section, where)
    if key not in fields:
        raise ValueError(f"unknown config key {section}.{key} in {where}{_did_you_mean(key, fields)}")
    section_obj = getattr(cfg, section)
    setattr(section_obj, key, parse_value(raw, _field_type(section_obj, key), f"{section}.{key}"))


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    """`--a.b v`, `--a.b=v`, and a bare `--a.b` (true, for bools) -> [("a.b", "v"), ...]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"unexpected argument {arg!r}: expected --section.key value")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            name, value = arg[2:], argv[i + 1]
            i += 2
        else:
            name, value = arg[2:], "true"
            i += 1
        pairs.append((name, value))
    return pairs


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults < the TOML named by `--job.config_file` < the other `--section.key value` overrides."""
    cfg = JobConfig()
    pairs = _split_cli(list(argv or []))
    config_file = next((v for k, v in pairs if k == "job.config_file"), None)
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"job.config_file {config_file!r} does not exist")
        with path.open("rb") as f:
            data = tomllib.load(f)
        for section, values in data.items():
            _section_fields(cfg, section, config_file)
            if not isinstance(values, dict):
                raise ValueError(f"{config_file}: [{section}] must be a table, found {values!r}")
            for key, raw in values.items():
                _set(cfg, section, key, raw, config_file)
    for name, raw in pairs:
        section, _, key = name.partition(".")
        _set(cfg, section, key, raw, "command line")
    return cfg


# ------------------------------------------------------------------------------------- output
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a JSON string is a valid TOML basic string


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (None-valued keys are left out: TOML has no null)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: JobConfig, folder: str | Path) -> Path:
    """Write config.toml and config.json into `folder`; returns the TOML path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    path = folder / "config.toml"
    path.write_text(to_toml(cfg))
    return path
