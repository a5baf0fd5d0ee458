"""The job's configuration sections: every key, its type, default and one-line doc.

Sections and keys are torchtitan v0.2.0's (`torchtitan/config/job_config.py`), so its TOML files load
unchanged; meshtrain adds a few of its own (marked "meshtrain:" in their docs). A key that cannot have an
effect here (wandb, fault tolerance, MX, MoE) is accepted at its default and refused, with the fix,
when set to something that would need it (`trainer/preflight.py`). `--help` prints this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class Job:
    config_file: str | None = None
    """TOML file the job was configured from (None: dataclass defaults and CLI only)."""
    dump_folder: str = "./outputs"
    """Folder for everything the job writes: the resolved config, tensorboard logs, checkpoints."""
    description: str = "meshtrain job"
    """Free-text description, logged at start."""
    print_config: bool = False
    """Log the resolved config (as TOML) at start."""
    custom_config_module: str = ""
    """torchtitan's config extension module; meshtrain has none ("" only)."""


@dataclass(kw_only=True)
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (Chrome JSON, one per rank) of a window of steps every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Under job.dump_folder: iteration_<N>/rank<R>_trace.json for the window ending at step N."""
    profile_freq: int = 10
    """Trace a window every this many steps: wait profile_freq - warmup - active steps, warm up, then record."""
    profiler_active: int = 1
    """Steps recorded in each window."""
    profiler_warmup: int = 3
    """Steps the profiler runs without recording before each window (its own start-up costs stay out)."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps (and on OOM), for
    pytorch.org/memory_viz; on CPU it is skipped with a warning."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Under job.dump_folder: iteration_<N>/rank<R>_memory_snapshot.pickle."""


@dataclass(kw_only=True)
class Metrics:
    log_freq: int = 1
    """Log the metrics line every this many steps (and at the last step)."""
    enable_tensorboard: bool = False
    """Also write the metrics to tensorboard under job.dump_folder/save_tb_folder."""
    disable_color_printing: bool = False
    """Accepted for torchtitan configs: meshtrain's metrics line has no colors."""
    save_tb_folder: str = "tb"
    """Under job.dump_folder: the tensorboard event files."""
    save_for_all_ranks: bool = False
    """Write tensorboard on every rank (save_tb_folder/rank_<R>), not only rank 0."""
    enable_wandb: bool = False
    """Weights & Biases logging: not available here (use enable_tensorboard)."""
    peak_tflops: float = 0.0
    """meshtrain: peak dense TFLOPS of one device for MFU (0: from the bf16 table by GPU name; on CPU MFU is n/a
    unless set)."""


@dataclass(kw_only=True)
class Model:
    name: str = "llama3"
    """Model family: "llama3", "qwen3" or "deepseek_v3" (models/registry.py)."""
    flavor: str = "debugmodel"
    """Key into the family's flavors (llama3_configs, qwen3_configs, deepseek_v3_configs)."""
    hf_assets_path: str = ""
    """A Hugging Face model folder: its tokenizer.json is the tokenizer (when tokenizer_path is ""), and its
    *.safetensors the weights checkpoint.initial_load_in_hf loads; "" is none."""
    tokenizer_path: str = ""
    """A Hugging Face tokenizer.json, or a folder holding one (BOS/EOS from tokenizer_config.json next to it,
    else from its special tokens); "" takes hf_assets_path's, or with neither the byte tokenizer (vocab 258)."""
    converters: list[str] = field(default_factory=list)
    """Model converters: ["float8"] runs the linears' matmuls in float8, tensorwise or rowwise scales (models.float8;
    [quantize.linear.float8] configures it, recipe_name picks the scales); MX is not implemented."""
    print_after_conversion: bool = False
    """Log the model after the converters ran."""
    vocab_size: int = 0
    """meshtrain: the model's vocabulary; 0 is the tokenizer's. Larger pads the embedding and output (e.g. 2048
    for the debugmodel's 2000-token tokenizer, or a multiple of the TP degree); smaller is an error."""


@dataclass(kw_only=True)
class Optimizer:
    name: str = "AdamW"
    """Optimizer; only "AdamW" exists."""
    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW)."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """AdamW kernel: "fused" (torchtitan's default: one kernel per step, DTensor parameters kept sharded),
    "foreach" or "for-loop"."""
    early_step_in_backward: bool = False
    """Step each parameter in its backward hook: not implemented (false only)."""


@dataclass(kw_only=True)
class LRScheduler:
    warmup_steps: int = 2
    """Steps of linear warmup from ~0 to optimizer.lr (more than training.steps is clamped, with a warning)."""
    decay_ratio: float | None = None
    """Fraction of training.steps spent decaying, at the end; the lr stays at its peak in between (warmup-
    stable-decay). None: decay over every step after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from optimizer.lr to min_lr_factor * lr."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass(kw_only=True)
class Training:
    dataset: str = "embedded"
    """Dataset: "embedded" (the corpus shipped in trainer/corpus/, no network) or a Hugging Face hub dataset name
    (split "train", streamed); with dataset_path set it only names the data."""
    dataset_path: str = ""
    """Local data instead: a file, folder or glob of .txt (each blank-line-separated paragraph a document),
    .json/.jsonl (JSON lines) or .parquet files, streamed in path order and tokenized on the fly. Several
    comma-separated paths ("a.jsonl,b/") are mixed by dataset_weights."""
    dataset_weights: list[float] = field(default_factory=list)
    """meshtrain: mixing weights of the comma-separated dataset_path entries, one per path in their order
    (>= 0, normalized to sum to 1; empty: equal): each source's share of the training tokens. Which source
    fills each row is a function of (seed, row), so the mix is the same at every dp degree and resumes."""
    local_batch_size: int = 2
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1: local_batch_size x dp degree.
    A multiple of that accumulates gradients over global / (local x dp) micro-batches."""
    seq_len: int = 256
    """Tokens per sequence (also the model's max_seq_len)."""
    max_norm: float = 1.0
    """Clip the global gradient 2-norm to this (<= 0 disables clipping, still logs the norm)."""
    steps: int = 10
    """Optimizer steps to train."""
    enable_cpu_offload: bool = False
    """FSDP CPU offload of parameters, gradients and optimizer state: not implemented (false only)."""
    dtype: Literal["bfloat16", "float32"] = "float32"
    """dtype of the parameters, gradients and optimizer state (bfloat16: no float32 master copy)."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """On CUDA, the dtype parameters compute in: FSDP all-gathers them in it; without FSDP the forward
    runs under torch.autocast. The CPU always trains in float32 (logged at start)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """On CUDA, the dtype of FSDP's gradient reduce-scatter."""
    gc_freq: int = 50
    """Python's automatic garbage collection is off; every rank collects every this many steps instead, so
    no rank pauses alone while the others wait in a collective."""
    gc_debug: bool = False
    """Collect at every step and log how many objects were unreachable (finds reference cycles; slow)."""
    seed: int | None = 0
    """Seed for weights and data order, identical on every rank; None: a random one (rank 0's, logged)."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms, cuDNN/cuBLAS settings)."""
    debug_moe_force_load_balance: bool = False
    """MoE routing debug switch: there is no MoE model here (false only)."""
    skip_nonfinite_steps: bool = False
    """meshtrain: on a NaN/inf loss or gradient norm, skip that optimizer step (counted) instead of stopping."""
    max_consecutive_skipped_steps: int = 10
    """meshtrain: with skip_nonfinite_steps, stop once this many steps in a row were non-finite (diverged)."""
    dataset_text_field: str = "text"
    """meshtrain: the field holding a document's text in JSON / parquet / hub rows."""


@dataclass(kw_only=True)
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicated data parallelism (HSDP outer dim)."""
    enable_compiled_autograd: bool = False
    """Compiled autograd: not supported here (false only)."""
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 takes whatever the other degrees leave of the world size."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free FSDP's unsharded parameters after forward: "always", "never" (more memory, no all-gather in
    backward), or "default" (always, except under pipeline parallelism)."""
    tensor_parallel_degree: int = 1
    """Tensor + sequence parallelism degree."""
    disable_loss_parallel: bool = False
    """With TP, gather the logits for the cross-entropy instead of keeping them sharded on the vocabulary."""
    enable_async_tensor_parallel: bool = False
    """Async TP: TP's all-gathers and reduce-scatters run as rings of sequence chunks under the matmuls
    (collective matmul), eager and compiled, on every backend; float8 linears stay synchronous."""
    pipeline_parallel_degree: int = 1
    """Pipeline parallelism degree: ranks along the pp mesh dim (outermost), each holding its stages."""
    module_fqns_per_model_part: list[list[str]] | None = None
    """Pipeline parallelism: the module names of each model part, an explicit split."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Pipeline parallelism: layers fewer on the first stage (the embedding's weight, counted in layers)."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Pipeline parallelism: layers fewer on the last stage (norm and output, counted in layers)."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Pipeline parallelism: transformer layers per stage (None: split evenly)."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule, case-insensitive: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV."""
    pipeline_parallel_schedule_csv: str = ""
    """Pipeline parallelism: a custom schedule as a CSV of actions per rank ("" none)."""
    pipeline_parallel_microbatch_size: int = 1
    """Pipeline parallelism: sequences per microbatch."""
    context_parallel_degree: int = 1
    """Context parallelism degree: each sequence is sharded over this many ranks (ring attention); FSDP shards
    parameters over data_parallel_shard_degree x this. training.seq_len must divide by 2 x this x TP degree."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """Context parallelism: how K/V blocks travel between ranks: "allgather" (one all-gather per attention) or
    "alltoall" (a ring of point-to-point passes overlapped with the block computation)."""
    expert_parallel_degree: int = 1
    """Expert parallelism: each MoE layer's routed experts are sharded over this many ranks and tokens travel to
    them by all-to-all. The ranks are borrowed from data_parallel_shard_degree x context_parallel_degree (x
    tensor_parallel_degree when expert_tensor_parallel_degree = 1); it must divide that and num_experts."""
    expert_tensor_parallel_degree: int = 1
    """Expert parallelism: 1 (ep borrows the tp ranks, which split the routed tokens) or tensor_parallel_degree
    (each expert is also sharded on its hidden dim over tp)."""
    enable_loss_parallel: bool = True
    """meshtrain: with TP, keep logits sharded on the vocabulary dim for the cross-entropy (false, or
    disable_loss_parallel=true, gathers them)."""


@dataclass(kw_only=True)
class Checkpoint:
    enable: bool = False
    """Save checkpoints, and resume from the latest committed one in `folder` on start."""
    enable_ft_dataloader_checkpoints: bool = True
    """Fault-tolerance data loader checkpoints: only with fault_tolerance, which does not exist here."""
    folder: str = "checkpoint"
    """Where checkpoints go, under job.dump_folder: one committed `step-<N>/` per save."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    initial_load_path: str = ""
    """With no checkpoint in `folder` yet, start from this checkpoint directory (e.g. made by `from-hf`),
    or with initial_load_in_hf from a Hugging Face folder; loaded whether or not `enable` saves."""
    initial_load_model_only: bool = True
    """From initial_load_path load only the model (not the optimizer, data position, ...)."""
    initial_load_in_hf: bool = False
    """initial_load_path (or, when it is "", model.hf_assets_path) is a Hugging Face safetensors folder."""
    initial_load_in_hf_quantized: bool = False
    """Quantized Hugging Face weights: not supported (false only)."""
    last_save_model_only: bool = True
    """The save at the last step holds only the model (in export_dtype): a smaller export, not a resume point."""
    last_save_in_hf: bool = False
    """Write the last save as a Hugging Face folder (model only, export_dtype) instead of a checkpoint."""
    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """dtype of the model in a model-only last save."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """"async": stage to CPU memory and write on a background thread (the loop waits only for the copy);
    "async_with_pinned_mem" stages into pinned memory on CUDA."""
    keep_latest_k: int = 10
    """Keep the newest k resumable checkpoints and the steps after them; older ones are deleted (0: keep all).
    A model-only save (the last save's export, a seed) does not count against them, so k=1 keeps the newest
    resume point next to the last save's export (torchtitan refuses k=1)."""
    load_step: int = -1
    """Resume from this step's checkpoint instead of the latest (-1: latest)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Top-level states not to resume (e.g. ["dataloader", "optimizer"])."""
    enable_first_step_checkpoint: bool = False
    """Also save after the first step."""
    create_seed_checkpoint: bool = False
    """Save the initialized model as step-0 and exit without training."""
    load_only: bool = False
    """Load checkpoints as usual but never save any."""


@dataclass(kw_only=True)
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing of transformer blocks: none, full, selective (see selective_ac_option), or
    memory_budget (compiled blocks only: torch.compile's min-cut partitioner chooses what they save)."""
    selective_ac_option: str = "2"
    """With mode=selective: an int N checkpoints every N-th block fully, "op" saves only the matmul and
    attention outputs of every block and recomputes the rest."""
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    """Op-level SAC: the matmuls of these linears (names ending so) are always recomputed and skip their turn in the
    every-other-matmul count (MoE routers; none in llama3)."""
    early_stop: bool = False
    """Stop each recomputation once the tensors backward needs are rebuilt (torch.utils.checkpoint's early stop)."""
    memory_budget: float = 0.5
    """With mode=memory_budget: the fraction of saving everything the compiled blocks may keep (0: recompute all)."""
    visualize_memory_budget_pareto: bool = False
    """With mode=memory_budget: plot the pareto front (not supported)."""


@dataclass(kw_only=True)
class Compile:
    enable: bool = False
    """torch.compile the components below with fullgraph=True, in every layout (our DTensor traces whole)."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What compile.enable compiles: "model" (each transformer block) and "loss" (the cross-entropy)."""
    backend: str = "inductor"
    """torch.compile backend: "inductor" (generated kernels), or "aot_eager" / "eager" to check tracing cheaply."""


@dataclass(kw_only=True)
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the float8 linears' weights in float8: each shard cast with the whole weight's scale (the
    same bytes as casting after the gather), a quarter of float32's all-gather bytes, half of bf16's; under TP
    too (the scale's amax then spans the TP shards)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: every float8 weight's scale computed after the optimizer step in one
    all-reduce, instead of one per FSDP group at its forward all-gather."""
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """float8 scaling recipe: None or "tensorwise" (one scale per tensor), "rowwise" (one per row of each
    matmul's left operand and column of its right one, e4m3 throughout, power-of-two scales) or
    "rowwise_with_gw_hp" (rowwise, the weight gradient in high precision); torchao's recipes."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linear modules left in high precision: any whose FQN contains one of these (e.g. ["output"])."""
    emulate: bool = False
    """float32 matmuls of the float8 values (GPUs before sm_89; the CPU's kernel does this anyway)."""


@dataclass(kw_only=True)
class Float8GroupedMM:
    fqns: list[str] = field(default_factory=list)
    """MoE grouped matmuls converted to float8 (no MoE here)."""


@dataclass(kw_only=True)
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: Literal["triton", "cuda", "torch"] = "triton"
    """MX cast kernel (only with model.converters=["mx"])."""
    recipe_name: str = "mxfp8_cublas"
    """MX recipe (only with model.converters=["mx"])."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear modules left in high precision (only with model.converters=["mx"])."""


@dataclass(kw_only=True)
class MXGroupedMM:
    recipe_name: Literal["mxfp8"] = "mxfp8"
    """MX recipe of MoE grouped matmuls (no MoE here)."""
    fqns: list[str] = field(default_factory=list)
    """MoE grouped matmuls converted to MX (no MoE here)."""


@dataclass(kw_only=True)
class QuantizedLinear:
    float8: Float8Linear = field(default_factory=Float8Linear)
    mx: MXLinear = field(default_factory=MXLinear)


@dataclass(kw_only=True)
class QuantizedGroupedMM:
    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)
    mx: MXGroupedMM = field(default_factory=MXGroupedMM)


@dataclass(kw_only=True)
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = field(default_factory=QuantizedGroupedMM)


@dataclass(kw_only=True)
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of process-group initialization and of every collective until the first step is done."""
    train_timeout_seconds: int = 100
    """Timeout of collectives after the first step (which may compile or load: it has init_timeout_seconds)."""
    trace_buf_size: int = 20000
    """NCCL flight-recorder entries per rank (CUDA; 0 disables it)."""
    save_traces_folder: str = "comm_traces"
    """Under job.dump_folder: where NCCL's flight recorder dumps on a timeout (CUDA)."""
    save_traces_file_prefix: str = "rank_"
    """File-name prefix of those dumps."""


@dataclass(kw_only=True)
class MemoryEstimation:
    enable: bool = False
    """Estimate memory before training: the dry run is its own command, `./run_train.sh --estimate` (false only)."""
    disable_fake_mode: bool = False
    """Run the estimate on real tensors (only with enable)."""


@dataclass(kw_only=True)
class FaultTolerance:
    enable: bool = False
    """torchft fault tolerance: not available here (false only); use MAX_RESTARTS and checkpoints."""
    process_group: str = "gloo"
    """torchft's replica process group (only with enable)."""
    process_group_timeout_ms: int = 10000
    """torchft's process-group timeout (only with enable)."""
    replica_id: int = 0
    """torchft replica id (only with enable)."""
    group_size: int = 0
    """torchft replica groups (only with enable)."""
    min_replica_size: int = 1
    """torchft's minimum replicas (only with enable)."""
    semi_sync_method: str | None = None
    """torchft semi-synchronous training (only with enable)."""


@dataclass(kw_only=True)
class Experimental:
    custom_import: str = ""
    """A module torchtitan imports to register models: meshtrain has no registry ("" only)."""
    custom_args_module: str = ""
    """A module extending the config: meshtrain has none ("" only)."""


@dataclass(kw_only=True)
class Validation:
    enable: bool = False
    """Compute the loss on held-out data every `freq` steps (and at the last step), without gradients."""
    dataset: str = "embedded"
    """"embedded": trainer/corpus/validation.txt, documents held out of the training corpus. Hub datasets are not
    read for validation (the loader reads split "train"); use dataset_path."""
    dataset_path: str = ""
    """Local held-out files (.txt, .json/.jsonl, .parquet: as training.dataset_path), read once per evaluation."""
    local_batch_size: int = 0
    """Sequences per data-parallel rank per validation batch; 0: training.local_batch_size."""
    seq_len: int = 0
    """Tokens per validation sequence, at most training.seq_len (the model's max_seq_len); 0: training.seq_len."""
    freq: int = 10
    """Validate every this many steps."""
    steps: int = -1
    """Validation batches per evaluation (each local_batch_size x dp sequences); -1: the whole held-out set once."""


@dataclass(kw_only=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    experimental: Experimental = field(default_factory=Experimental)
    validation: Validation = field(default_factory=Validation)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
