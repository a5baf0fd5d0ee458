"""The whole model's step trace from short traces (`trace_step_sampled`): a 126-block model costs what a 4-block
one does, a 405B pipeline stage of 16 blocks what a 2-block one does.

Every byte, collective, FLOP and token count of a step is affine in the number of identical blocks, and, under
pipeline parallelism, in the microbatches of a schedule past its warm-up (`microbatches.py` picks the counts).
So two traces put on a line give the real one, provided both peak at the same moment of the step: a category
that shrinks between them says the peak moved, and another count is traced instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from models.registry import flavor_args

from ..config.pipeline_setup import PipelineSetup, resolve_pipeline
from ..config.sections import JobConfig
from ..runtime import Runtime
from .live_bytes import MemoryReport
from .microbatches import microbatch_samples
from .trace import Collective, StepTrace, trace_pipeline_step, trace_step


def _affine(a: int, b: int, k1: int, k2: int, n: int) -> int:
    """The value at n of the line through (k1, a) and (k2, b): exact for a stack of identical blocks."""
    return a + (b - a) * (n - k1) // (k2 - k1)


def _affine_trace(small: StepTrace, large: StepTrace, k1: int, k2: int, n: int) -> StepTrace:
    """The trace at n from traces at k1 and k2 of a quantity every byte, collective, FLOP and token count of the
    step is affine in; the peak's place is `large`'s."""

    def line(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: _affine(a.get(k, 0), b[k], k1, k2, n) for k in b}

    at_peak = line(small.memory.at_peak, large.memory.at_peak)
    peak = sum(at_peak.values())
    # the allocator's cache over the live peak is taken from `large` (it barely moves between samples: 8B FSDP 8
    # 6.78 GiB at 2 blocks, 6.80 at 4), not put on a line, which can fall under the live peak (70B FSDP 32 x TP 8:
    # 50.6 GiB reserved for 57.8 live). Whole-model traces cache more, as fragmentation grows with the blocks
    # (reserved, whole / sampled: 8B 78.7 / 74.6 GiB, 70B 72.6 / 68.2, a 405B PP stage 76.0 / 69.4): 5-9% low
    cache = large.memory.reserved - large.memory.peak
    memory = MemoryReport(at_peak=at_peak, peak=peak, peak_where=large.memory.peak_where,
                          steady=line(small.memory.steady, large.memory.steady), reserved=peak + cache)  # fmt: skip
    before = {(c.kind, c.mesh_dim): c for c in small.collectives}
    collectives = []
    for c in large.collectives:
        b = before.get((c.kind, c.mesh_dim), Collective(c.kind, c.mesh_dim, 0, 0))
        collectives.append(Collective(c.kind, c.mesh_dim, _affine(b.count, c.count, k1, k2, n),
                                      _affine(b.bytes, c.bytes, k1, k2, n)))  # fmt: skip
    return dataclasses.replace(
        large, memory=memory, collectives=collectives, comm_counts=line(small.comm_counts, large.comm_counts),
        comm_bytes=line(small.comm_bytes, large.comm_bytes),
        executed_flops=_affine(small.executed_flops, large.executed_flops, k1, k2, n),
        float8_flops=_affine(small.float8_flops, large.float8_flops, k1, k2, n),
        float8_casts=_affine(small.float8_casts, large.float8_casts, k1, k2, n),
        local_tokens=_affine(small.local_tokens, large.local_tokens, k1, k2, n),
    )  # fmt: skip


def extrapolate(small: StepTrace, large: StepTrace, n_layers: int) -> StepTrace:
    """The whole model's trace from traces of its first k1 and k2 blocks: every byte count, collective count
    and FLOP count of a step is affine in the number of identical blocks (the peak moves with them)."""
    k1, k2 = small.n_layers, large.n_layers
    whole = _affine_trace(small, large, k1, k2, n_layers)
    where = re.sub(r"layers\.(\d+)", lambda m: f"layers.{n_layers - k2 + int(m[1]) if int(m[1]) >= k1 else m[1]}",
                   large.memory.peak_where)  # fmt: skip
    return dataclasses.replace(whole, memory=dataclasses.replace(whole.memory, peak_where=where), n_layers=n_layers)


SAMPLED_LAYERS = (2, 4)  # blocks traced when sampling: even counts keep every-other-layer AC's pattern


def _same_moment(small: StepTrace, large: StepTrace) -> bool:
    """Whether two traces of a stack of identical blocks peak at the same moment of the step: there each category
    holds at least as much with more blocks. (A category that shrinks says the peak moved: 405B's first pipeline
    stage peaks in its last backward with gradients at 1 block per stage, before any at 2.)"""
    return all(large.memory.at_peak[c] >= small.memory.at_peak.get(c, 0) for c in large.memory.at_peak)


def _blocks_on_a_line(
    trace_at: Callable[[int], StepTrace], k1: int, dk: int, n_layers: int, whole: Callable[[], StepTrace]
) -> StepTrace:
    """The trace of `n_layers` blocks from the line through two traces (`trace_at(k)`: k blocks, or k per stage)
    that peak at the same moment of the step, where every category is affine in the blocks. While two do not, the
    next count is traced (k + dk); `whole` traces every block once a count reaches the model's."""
    small, k = trace_at(k1), k1 + dk
    while True:
        large = trace_at(k)
        if large.n_layers >= n_layers:
            return whole()
        if _same_moment(small, large):
            return extrapolate(small, large, n_layers)
        small, k = large, k + dk


def _with_setup_of(cfg: JobConfig, runtime: Runtime, *, n_layers: int | None = None) -> Runtime:
    """`runtime` with the pipeline setup of `cfg`, a variant of the job's config that the dry run traces (fewer
    blocks or microbatches), resolved once for it as the trainer resolves the job's."""
    return dataclasses.replace(runtime, pipeline=resolve_pipeline(cfg, n_layers=n_layers))


def _with_blocks_per_stage(cfg: JobConfig, setup: PipelineSetup, k: int) -> JobConfig:
    """`cfg` with an explicit split giving every stage k blocks (numbered stage by stage) and its other modules."""
    split = []
    for s, fqns in enumerate(setup.stage_fqns):
        blocks = [f"layers.{s * k + i}" for i in range(k)]  # in forward order: embedding, blocks, norm, output
        split.append([f for f in fqns if f == "tok_embeddings"] + blocks + [f for f in fqns if f in ("norm", "output")])
    parallelism = dataclasses.replace(cfg.parallelism, module_fqns_per_model_part=split)
    return dataclasses.replace(cfg, parallelism=parallelism)


def _trace_blocks_per_stage(cfg: JobConfig, runtime: Runtime, fake: bool, k: int) -> StepTrace:
    """This rank's stages with k blocks each, their other modules (embedding, norm, output) as they are."""
    assert runtime.pipeline is not None, "a pipeline step's runtime holds its pipeline setup"
    variant = _with_blocks_per_stage(cfg, runtime.pipeline, k)
    n_layers = k * runtime.pipeline.num_stages
    return trace_pipeline_step(variant, _with_setup_of(variant, runtime, n_layers=n_layers), fake=fake,
                               n_layers=n_layers)  # fmt: skip


def _sampled_blocks(cfg: JobConfig, runtime: Runtime, fake: bool, blocks: int) -> StepTrace:
    """This rank's stages traced at 1 and 2 blocks each (more while their peaks differ), on a line to `blocks`."""
    return _blocks_on_a_line(
        lambda k: _trace_blocks_per_stage(cfg, runtime, fake, k), 1, 1, blocks,
        lambda: trace_pipeline_step(cfg, runtime, fake=fake),
    )  # fmt: skip


def _sampled_microbatches(
    cfg: JobConfig, runtime: Runtime, trace: Callable[[JobConfig, Runtime], StepTrace]
) -> StepTrace:
    """This rank's pipeline step (`trace` of a config) traced at two smaller microbatch counts and put on a line
    (`estimate_microbatches`: the simulator picks the cheapest pair that gives the real count's peak); traced
    at the real count when no pair is cheaper."""
    assert runtime.pipeline is not None, "a pipeline step's runtime holds its pipeline setup"
    m = runtime.pipeline.microbatches
    samples = microbatch_samples(runtime.pipeline, runtime.world_mesh["pp"].get_local_rank())
    if samples is None:
        return trace(cfg, runtime)
    k1, k2 = samples.small, samples.large
    small_cfg, large_cfg = (_with_microbatches(cfg, k, runtime.dp_size) for k in (k1, k2))
    small = trace(small_cfg, _with_setup_of(small_cfg, runtime))
    large = trace(large_cfg, _with_setup_of(large_cfg, runtime))
    if not samples.peak_from_large and not _same_moment(small, large):  # the peak moved: no line through them
        return trace(cfg, runtime)
    line = _affine_trace(small, large, k1, k2, m)
    if samples.peak_from_large:  # the warm-up is over at k2: the rank holds what it holds at m
        peak = large.memory
        line = dataclasses.replace(
            line,
            memory=dataclasses.replace(
                line.memory, at_peak=peak.at_peak, peak=peak.peak, peak_where=peak.peak_where, reserved=peak.reserved
            ),
        )
    return line


def _with_microbatches(cfg: JobConfig, m: int, dp: int) -> JobConfig:
    """`cfg` with m pipeline microbatches per accumulation step, the accumulation steps as they were."""
    training = cfg.training
    local = m * cfg.parallelism.pipeline_parallel_microbatch_size
    if training.global_batch_size > 0:  # keep the accumulation steps
        accumulation = training.global_batch_size // (training.local_batch_size * dp)
        scaled = dataclasses.replace(training, local_batch_size=local, global_batch_size=local * dp * accumulation)
    else:
        scaled = dataclasses.replace(training, local_batch_size=local)
    return dataclasses.replace(cfg, training=scaled)


def trace_step_sampled(cfg: JobConfig, runtime: Runtime, *, fake: bool = True, every_block: bool = False) -> StepTrace:
    """`trace_step` of the whole model from two short traces (SAMPLED_LAYERS blocks), extrapolated: a 126-block
    model costs what a 4-block one does. Falls back to the whole model when it has no more blocks than that.
    Under PP each stage of this rank is traced with 1 and then 2 blocks, extrapolated to its real blocks (a
    405B stage of 16 blocks costs what a 2-block one does), each at two smaller microbatch counts
    (`_sampled_microbatches`). `every_block` traces every block (microbatches still sampled)."""
    trace = _traced_from_samples(cfg, runtime, fake=fake, every_block=every_block)
    negative = {k: v for k, v in trace.memory.at_peak.items() if v < 0}
    assert not negative, f"a negative memory category at the peak: {negative}"  # samples at one moment exclude it
    return trace


def _traced_from_samples(cfg: JobConfig, runtime: Runtime, *, fake: bool, every_block: bool) -> StepTrace:
    if runtime.pipeline is not None:
        setup = runtime.pipeline
        mine = setup.stages_of(runtime.world_mesh["pp"].get_local_rank())
        blocks = sum(sum(f.startswith("layers.") for f in setup.stage_fqns[s]) for s in mine)
        if every_block or blocks <= 2 * len(mine):
            return _sampled_microbatches(cfg, runtime, lambda c, r: trace_pipeline_step(c, r, fake=fake))
        return _sampled_microbatches(cfg, runtime, lambda c, r: _sampled_blocks(c, r, fake, blocks))
    n_layers = flavor_args(cfg.model.name, cfg.model.flavor).n_layers
    # DeepSeek's dense first blocks are in every sample: the line runs through its MoE blocks
    dense = getattr(flavor_args(cfg.model.name, cfg.model.flavor), "n_dense_layers", 0)
    k1, k2 = (dense + k for k in SAMPLED_LAYERS)
    if every_block or n_layers <= k2:
        return trace_step(cfg, runtime, fake=fake)
    return _blocks_on_a_line(
        lambda k: trace_step(cfg, runtime, fake=fake, layers=k), k1, k2 - k1, n_layers,
        lambda: trace_step(cfg, runtime, fake=fake),
    )  # fmt: skip
