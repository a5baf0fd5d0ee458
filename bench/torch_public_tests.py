"""Run torch's own public-API DTensor / tensor-parallel tests on torch and on meshtrain.

The test sources are torch's (never copied into this repo): point the runner at a pytorch
checkout (`--src DIR`, the folder that holds `test/distributed/...`) or at a bare git dir and a
revision (`--git-dir DIR --rev v2.13.0`). Each chosen file is copied into a temp dir twice:

- `torch/`: unchanged;
- `ours/`: only the imports rewritten (`torch.distributed.tensor` -> `parallelisms.dtensor`,
  `.parallel` -> `parallelisms.tensor_parallel`, `.debug` / `.experimental` ->
  `parallelisms.dtensor.debug` / `.experimental`, `torch.distributed.device_mesh` ->
  `parallelisms.dtensor.device_mesh`). Private modules (`torch.distributed.tensor._*`) stay
  torch's. The test harness `common_dtensor` builds meshes and models from the public names too,
  so `ours/` gets a copy of it with the same rewrite, and the tests import that copy.

Both sides run under pytest (CPU, gloo), one file at a time, with the per-test ranks forked rather
than spawned (`--spawn` for torch's own way; only the process start differs). torch's outcomes are
cached per file source, -k and torch version (`--cache`, `--refresh`). Tests of a continuous class
that torch's harness skips after an earlier failure are run again on their own. Tests of torch
internals (SKIPS, with the reason) are not counted and, unless `--run-skipped`, not run. A stored
test source a little newer than the installed torch may import a name torch 2.13 spells otherwise:
the conftest adds only such missing names, the same on both sides. The report lists per-file pass
counts, the tests that pass on torch but fail on ours, and one JSON line.

Every `test_*.py` under the source's test/distributed/tensor (subfolders parallel/, debug/,
experimental/ included) is found and run unless EXCLUDED_FILES names it, with the reason printed:
nothing in it runs on CPU/gloo (CUDA, XLA, inductor-on-GPU, accelerator-only classes), it tests
torch.compile/export of torch's own DTensor, it tests torch internals only, or the stored source
imports a module torch 2.13 lacks. The code index stores one version of each file, not always the
v2.13.0 one; where the stored newest registers its classes for accelerators only, a stored older
CPU-running version was measured instead (parallel/test_tp_style, parallel/test_tp_examples,
experimental/test_local_map), and parallel/test_parallelize_api comes from a copy embedded in a
docs page (the index's own copy predates torch 2.x APIs). The session report lists each source.

    python bench/torch_public_tests.py --src ~/pytorch
    python bench/torch_public_tests.py --src ~/pytorch --files test_init.py -k zeros
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_ROOT = "test/distributed/tensor"

# Every `test_*.py` under TEST_ROOT (subfolders included) is run unless named here. Whole files
# are left out only when nothing in them can run on CPU/gloo, or when all they test is torch's
# private machinery (sharding-rule registries, strategies, compiler integration); single tests of
# torch internals inside a run file are SKIPS below. Each is printed with its reason.
_CPU = "cannot run on CPU/gloo"
_ACC = f"{_CPU}: the stored version registers its classes with instantiate_device_type_tests(except_for=['cpu'])"
_INTERNALS = "tests torch internals only"
_COMPILE = "tests torch.compile/export of torch's DTensor subclass (dynamo, AOTAutograd, inductor): compiler internals"
_NEWER = "the stored version imports a module torch 2.13 lacks, so it cannot import on torch either"
EXCLUDED_FILES: dict[str, str] = {
    # nothing runs on CPU/gloo
    "test_xla_integration.py": f"{_CPU}: needs torch_xla (XLA SPMD)",
    "test_fake.py": f"{_CPU}: @requires_nccl (CUDA mesh under FakeTensorMode)",
    "test_dynamic.py": f"{_CPU}: @requires_gpu, torch.compile(dynamic=True) with inductor",
    "test_flex_attention.py": f"{_CPU}: flex attention needs torch.compile with inductor on GPU",
    "test_attention.py": f"{_CPU}: context parallel over CUDA SDPA kernels, torch's private experimental._attention",
    "test_gated_delta.py": f"{_CPU}: every test is @skip_if_lt_x_gpu(2); {_NEWER} (nn.modules.gated_delta)",
    "parallel/test_micro_pipeline_tp.py": f"{_CPU}: async TP over CUDA symmetric memory and inductor",
    "parallel/test_fsdp_2d_parallel.py": f"{_CPU}: FSDP x TP on CUDA, @skip_if_lt_x_gpu(4)",
    "parallel/test_ddp_2d_parallel.py": f"{_CPU}: DDP x TP on CUDA, @skip_if_lt_x_gpu(4)",
    "parallel/test_2d_parallel.py": f"{_CPU}: FSDP x TP with .cuda(), @skip_if_lt_x_gpu(4), removed PairwiseParallel",
    "parallel/test_tp_ddp_2d.py": f"{_CPU}: DDP x TP with .cuda(), @skip_if_lt_x_gpu(4), removed PairwiseParallel",
    "parallel/test_dtensor_error_repro.py": f"{_CPU}: CUDA hang repros, @skip_if_lt_x_gpu(4), removed PairwiseParallel",
    "parallel/test_shard_embedding.py": f"{_CPU}: every test is @skip_unless_torch_gpu",
    "parallel/test_tp_random_state.py": f"{_ACC} (and @skip_if_lt_x_gpu(4))",
    "experimental/test_register_sharding.py": _ACC,
    # compiler integration
    "test_dtensor_compile.py": _COMPILE,
    "test_dtensor_export.py": _COMPILE,
    "test_export.py": _COMPILE,
    "test_compile_on_one_rank.py": _COMPILE,
    "test_monotonic_compile.py": _COMPILE,
    "parallel/test_tp_examples_compile.py": _COMPILE,
    "experimental/test_tp_transform.py": f"{_COMPILE} (torch's private experimental._tp_transform)",
    # torch internals
    "test_common_rules.py": f"{_INTERNALS}: einop/pointwise rules on private DTensorSpec/OpSchema",
    "test_op_strategy.py": f"{_INTERNALS}: sharding strategies and their costs",
    "test_op_schema.py": f"{_INTERNALS}: private OpSchema",
    "test_single_dim_strategy.py": f"{_INTERNALS}: private single-dim strategy registry",
    "test_strategy_validation.py": f"{_INTERNALS}: validates torch's registered strategies",
    "test_strategy_registration.py": f"{_INTERNALS}: strategy registration",
    "test_decomp_sharding.py": f"{_INTERNALS}: strategies derived from decompositions",
    "test_partial_propagation.py": f"{_INTERNALS}: swaps torch's op_strategy_funcs for an experimental strategy",
    "test_cute_view_propagation.py": f"{_INTERNALS}: CuTe-layout prototype on private _pycute, no DTensor",
    "test_utils.py": f"{_INTERNALS}: private _utils.compute_local_shape_and_global_offset and friends",
    "test_shards_wrapper.py": f"{_INTERNALS}: private _shards_wrapper.LocalShardsWrapper, no DTensor",
    "test_dtensor_testbase.py": "tests torch's test harness (a 30-rank DTensorTestBase mesh), not DTensor",
    "test_dtensor_logging.py": f"{_INTERNALS}: TORCH_LOGS=dtensor output",
    "test_dtensor_dispatch_overhead.py": f"{_INTERNALS}: timing of torch's own dispatch path",
    "debug/test_debug_mode.py": f"{_INTERNALS}: private torch.utils._debug_mode.DebugMode traces",
    "debug/test_op_coverage.py": f"{_INTERNALS}: private debug._op_coverage",
    "parallel/test_tp_fsdp_shard_metadata.py": f"{_INTERNALS}: private parallel.fsdp._get_box_for/_chunk_tensor",
    "parallel/test_view_sharding_dim_change.py": f"{_INTERNALS}: private parallel._view_with_dim_change (gone in 2.13)",
    "parallel/test_dtensor_2d.py": "a debugging repro with no assertions (prints private _utils results)",
    "test_send_recv.py": "a script with no test cases (LocalTensorMode send/recv demo)",
    # stored source newer than torch 2.13
    "test_block_shard.py": f"{_NEWER} (placement_types.BlockShard)",
    "test_decomposed_ops.py": f"{_NEWER} (_ops._decomposed_ops)",
    "test_memory_sharded.py": f"{_NEWER} (_memory_sharded, memory_saving)",
    "test_mst_fsdp_demo.py": f"{_NEWER} (memory_saving)",
    # runs on CPU but does not fit a measurement run
    "test_dtensor_ops.py": "OpInfo sweep of every aten op over DTensor: too long for a CPU measurement run",
    "test_dynamic 2.py": "a stray copy of test_dynamic.py (space in the name), not a test module",
}

# Tests that exercise torch internals rather than public behaviour: not counted against us.
# Keys are "<file>::<Class>::<test>", "<Class>::<test>", a test name, or a class name.
_PRIVATE_SPEC = "builds a DTensor straight from torch's private DTensorSpec/TensorMeta (torch internals)"
SKIPS: dict[str, str] = {
    "TestCommModeGeneric::test_comm_mode": "counts funcol collectives on torch's fake process group (torch internals)",
    "TestCommModeGeneric::test_comm_mode_coalesced": "funcol all_reduce_coalesced on torch's fake backend",
    "TestCommModeGeneric::test_comm_mode_with_dtensor": (
        "needs torch's private _redistribute.use_min_cost_redistribution_plan planner knob, on a fake pg"
    ),
    "DTensorTest::test_dtensor_constructor": _PRIVATE_SPEC,
    "DTensorTest::test_to_local": _PRIVATE_SPEC,
    "DTensorTest::test_shard_tensor": "calls torch's private _api._shard_tensor",
    "DTensorTest::test_shard_tensor_2d": "calls torch's private _api._shard_tensor",
    "DTensorMeshTest::test_dtensor_spec_local_shard_offset": (
        "calls torch's private _utils.compute_local_shape_and_global_offset on the mesh"
    ),
    "TestDTensorSpec": "torch's private DTensorSpec shard_order bookkeeping",
    "DistTensorOpsTest::test_gather": "asserts torch's private _MaskPartial placement class",
    "DistTensorOpsTest::test_stack_cache": "patches torch's private ShardingPropagator",
    "DistTensorOpsTest::test_dtensor_dtype_conversion": "reads torch's private sharding-propagation cache stats",
    "DistTensorOpsTest::test_single_dim_strategy_dtype_cache_key": "patches torch's private strategy registry",
    "DistBucketizeTest": "runs under torch's private LocalTensorMode",
    # test_redistribute.py
    "RedistributeTest::test_replicate_to_partial": "calls torch's private _redistribute.Redistribute.apply",
    "RedistributeTest::test_shard_dim_alltoall_float32": "calls torch's private _collective_utils.shard_dim_alltoall",
    "RedistributeTest::test_shard_dim_alltoall_complex64": "calls torch's private _collective_utils.shard_dim_alltoall",
    **dict.fromkeys(
        (
            "RedistributeTest::test_all_gather_view_optimization_batch1",
            "RedistributeTest::test_all_gather_no_optimization_gather_dim_not_1",
            "RedistributeTest::test_all_gather_split_cat_fallback_batch_gt_1",
        ),
        "asserts the aten ops inside torch's all-gather (view vs split+cat), traced by torch's private DebugMode",
    ),
    "DistributeWithDeviceOrderTest": "torch's private shard_order (ShardOrderEntry) placements and planner traces",
    "TransformInfoTest": "torch's private _redistribute._TransformInfo",
    "OptimizeFlattenedReductionsTest": "torch's private _optimize_transform_infos, on torch's fake process group",
    # test_embedding_ops.py
    "TestEmbeddingOp::test_sharded_embedding_rowwise": "asserts torch's private _MaskPartial placement class",
    "TestEmbeddingOp::test_multiple_embeddings_rowwise": "asserts torch's private _MaskPartial placement class",
    # test_dtensor.py
    "DTensorTest::test_dtensor_async_output": (
        "asserts the type is torch's private _functional_collectives.AsyncCollectiveTensor (ours: PendingTensor, "
        "which also waits on first use)"
    ),
    # test_placement_types.py
    **dict.fromkeys(
        (
            "PlacementTypesTestCase::test_select_split_tensor_matches_split_tensor",
            "PlacementTypesTestCase::test_select_split_tensor_symint_with_padding_raises",
        ),
        "calls torch's private Shard._select_split_tensor/_split_tensor",
    ),
    "PlacementTypesTestCase::test_strided_shard_kwonly_argument": "torch's private _StridedShard constructor signature",
    "PlacementTypesTestCase::test_placements_subclass_opaque_base": "torch's C++ OpaqueBase behind its placements",
    "PlacementTypesTestCase::test_placement_python_subclass_must_initialize_pybind_base": "torch's pybind base",
    # test_math_ops.py
    "DistMathOpsTest::test_layer_norm_fwd": "asserts the output's private _spec.tensor_meta is torch's TensorMeta",
    "DistMathOpsTest::test_layer_norm_bwd": "reads the private DTensorSpec.dim_map (torch's _ops.utils)",
    # test_view_ops.py
    "TestViewOps::test_view_groups": "only torch's private _view_ops.view_groups, no DTensor",
    # test_matrix_ops.py
    "DistMatrixOpsTest::test_gen_single_dim_einsum_strategies_bias_reduce_op": "torch's private strategy generator",
    "DistMatrixOpsTest::test_mm_single_dim_strategy": "registers into torch's private single-dim strategy registry",
    # test_random_ops.py
    "DistTensorRandomOpTest::test_philox_state_seed_roundtrip": "torch's private _random._PhiloxState",
    # test_decompositions.py
    "TestDecompSharding::test_custom_recursive_decomp": "reads torch's private sharding-propagation cache info",
    "TestDecompSharding::test_misc_ops_with_no_sharding_rules": "inspects torch's private _op_dispatcher registries",
    "DTensorTest::test_dtensor_save_load_import": (
        "matches the hint torch's weights-only unpickler hard-codes for torch.distributed.tensor's own module"
    ),
}
# Classes made by common_dtensor.create_local_tensor_test_class rerun a class under torch's private
# LocalTensor simulation mode (torch.distributed._local_tensor): torch internals, not counted.
SKIP_CLASS_SUFFIXES = {"WithLocalTensor": "torch's private LocalTensor simulation mode"}

# Longest prefix first: the first match wins.
_MODULE_MAP = (
    ("torch.distributed.tensor.parallel", "parallelisms.tensor_parallel"),
    ("torch.distributed.tensor.debug", "parallelisms.dtensor.debug"),
    ("torch.distributed.tensor.experimental", "parallelisms.dtensor.experimental"),
    ("torch.distributed.tensor.device_mesh", "parallelisms.dtensor.device_mesh"),
    ("torch.distributed.tensor.placement_types", "parallelisms.dtensor.placements"),
    ("torch.distributed.device_mesh", "parallelisms.dtensor.device_mesh"),
    ("torch.distributed.tensor", "parallelisms.dtensor"),
    ("torch.distributed._tensor", "parallelisms.dtensor"),  # torch's deprecated alias of the above
)
_DOTTED = re.compile(r"\btorch\.distributed\.(?:_tensor|tensor|device_mesh)(?:\.[A-Za-z_]\w*)*")
_HARNESS = "torch.testing._internal.distributed._tensor.common_dtensor"
_OUR_HARNESS = "common_dtensor_ours"


def rewrite_dotted(name: str) -> str:
    """One dotted name, rewritten when it is public (no `_`-prefixed part below torch.distributed)."""
    for theirs, ours in _MODULE_MAP:
        if name == theirs or name.startswith(theirs + "."):
            rest = name[len(theirs) :]
            if any(part.startswith("_") for part in rest.split(".") if part):
                return name  # a private module or attribute: torch internals stay torch's
            return ours + rest
    return name


# `from torch.distributed.tensor import _random`: private names of a public module stay torch's
_PRIVATE_FROM = re.compile(
    r"^(\s*from\s+)(torch\.distributed\.(?:_tensor|tensor|device_mesh)[\w.]*)(\s+import\s+_)", re.M
)


# torch's backward-compatible private spellings of public names (`_Partial = Partial` in
# placement_types): they name the public class, so they are imported as ours.
_BC_ALIASES = {"_Partial": "Partial"}
_BC_IMPORT = re.compile(
    r"^(\s*from\s+torch\.distributed\.(?:_tensor|tensor)(?:\.placement_types)?\s+import\s+)("
    + "|".join(_BC_ALIASES)
    + r")\s*$",
    re.M,
)


def rewrite_imports(source: str) -> str:
    """The test file with only its module paths swapped to ours (harness included)."""
    source = source.replace(_HARNESS, _OUR_HARNESS)
    source = _BC_IMPORT.sub(lambda m: f"{m.group(1)}{_BC_ALIASES[m.group(2)]} as {m.group(2)}", source)
    source = _PRIVATE_FROM.sub(lambda m: m.group(1) + m.group(2).replace(".", "\0") + m.group(3), source)
    source = _DOTTED.sub(lambda m: rewrite_dotted(m.group(0)), source)
    source = source.replace("\0", ".")  # the protected private imports, as they were
    # attribute uses such as `parallelisms.dtensor.ones(...)` need the package bound as a name
    lines = source.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("import ", "from ")) and not line.startswith("from __future__"):
            lines.insert(i, "import parallelisms.dtensor  # noqa: F401\n")
            lines.insert(i + 1, "import parallelisms.tensor_parallel  # noqa: F401\n")
            break
    return "".join(lines)


@dataclass
class FileResult:
    passed: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    deselected: set[str] = field(default_factory=set)  # SKIPS entries not run
    error: str = ""


def discover_files(args: argparse.Namespace) -> list[str]:
    """Every `test_*.py` under TEST_ROOT of the source (paths relative to it, sorted): the set
    measured is whatever the pytorch checkout or revision holds, not a list kept here."""
    if args.src:
        root = Path(args.src) / TEST_ROOT
        found = [p.relative_to(root).as_posix() for p in root.rglob("test_*.py")]
    else:
        cmd = ["git", "--git-dir", args.git_dir, "ls-tree", "-r", "--name-only", args.rev, TEST_ROOT]
        names = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
        found = [n[len(TEST_ROOT) + 1 :] for n in names if re.fullmatch(r"test_[^/]*\.py", n.rsplit("/", 1)[-1])]
    return sorted(found)


def read_sources(args: argparse.Namespace, files: list[str]) -> dict[str, str]:
    sources = {}
    for rel in files:
        path = f"{TEST_ROOT}/{rel}"
        if args.src:
            sources[rel] = (Path(args.src) / path).read_text()
        else:
            cmd = ["git", "--git-dir", args.git_dir, "show", f"{args.rev}:{path}"]
            sources[rel] = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return sources


def harness_source() -> str:
    import torch.testing._internal.distributed._tensor.common_dtensor as harness

    return Path(harness.__file__).read_text()


# Both sides: torch's per-test harness (MultiProcessTestCase) spawns fresh interpreters for every
# test (each re-imports torch: 5-20 s a test on a small machine); forking the already-imported
# pytest process gives the same ranks in a fraction of that. Only the process start differs.
_FORK_CONFTEST = """
import torch.multiprocessing
from torch.testing._internal.common_distributed import MultiProcessTestCase


def _fork_processes(self):
    self._start_processes(torch.multiprocessing.get_context("fork").Process)


MultiProcessTestCase._spawn_processes = _fork_processes
"""


# Both sides: the stored test sources can be a little newer than the installed torch, and import
# a harness name or a private helper that torch 2.13 spells differently. Only names torch lacks are
# added (as torch's newer code defines them), identically on both sides, so a test still passes or
# fails on its own merits; nothing that exists is replaced.
_COMPAT_CONFTEST = """
import enum

import torch.distributed.tensor._redistribute as _redistribute
import torch.testing._internal.common_utils as _common_utils

if not hasattr(_common_utils, "HardwareClassification"):  # CI metadata on newer test classes

    class HardwareClassification(enum.Enum):
        GENERIC = "generic"
        ACCELERATOR = "accelerator"

    _common_utils.HardwareClassification = HardwareClassification

if not hasattr(_redistribute, "_assert_no_mixed_partial_types"):  # renamed after 2.13
    _redistribute._assert_no_mixed_partial_types = _redistribute.assert_no_mixed_partial_types
"""


# Both sides: tests of torch internals (SKIPS) are not counted, so by default they are not run
# either (some take minutes: exhaustive shard-order sweeps, LocalTensor simulations of 8 ranks in
# one process). The names deselected are written beside the junit xml for the report.
_DESELECT_CONFTEST = """
import os

from bench.torch_public_tests import skip_reason


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MESHTRAIN_RUN_SKIPS") == "1":
        return
    keep, dropped = [], []
    for item in items:
        file = item.nodeid.split("::")[0].rsplit("__", 1)[-1]
        cls = item.cls.__name__ if item.cls is not None else ""
        name = f"{file}::{cls}::{item.name}"
        (dropped if skip_reason(name) else keep).append((item, name))
    if dropped:
        config.hook.pytest_deselected(items=[item for item, _ in dropped])
        items[:] = [item for item, _ in keep]
        with open(os.environ["MESHTRAIN_DESELECTED"], "a") as f:
            f.writelines(name + "\\n" for _, name in dropped)
"""


def prepare(workdir: Path, sources: dict[str, str], fork: bool) -> None:
    for side in ("torch", "ours"):
        (workdir / side).mkdir(parents=True, exist_ok=True)
        conftest = _COMPAT_CONFTEST + _DESELECT_CONFTEST + (_FORK_CONFTEST if fork else "")
        (workdir / side / "conftest.py").write_text(conftest)
        for rel, text in sources.items():
            dst = workdir / side / rel.replace("/", "__")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text if side == "torch" else rewrite_imports(text))
    (workdir / "ours" / f"{_OUR_HARNESS}.py").write_text(rewrite_imports(harness_source()))


def run_pytest(workdir: Path, side: str, rel: str, keyword: str | None, timeout: int) -> FileResult:
    """One file on one side. torch's continuous test classes skip the rest of a class after a
    failure ("Previous test failed"); those tests are run again by node id until none is left."""
    test_file = workdir / side / rel.replace("/", "__")
    result = FileResult()
    targets = [str(test_file)]
    for attempt in range(50):
        xml_path = workdir / f"{side}-{test_file.stem}-{attempt}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets, f"--junitxml={xml_path}"]
        if keyword:
            cmd += ["-k", keyword]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(workdir / side), str(REPO)]),
            CUDA_VISIBLE_DEVICES="",
            MESHTRAIN_DESELECTED=str(workdir / f"{side}-{test_file.stem}-deselected.txt"),
        )
        try:
            proc = subprocess.run(cmd, cwd=workdir / side, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            result.error = f"timed out after {timeout}s"
            return result
        if not xml_path.exists():
            result.error = (proc.stdout + proc.stderr)[-2000:]
            return result
        targets = _read_junit(xml_path, rel, test_file, result)
        if not targets:
            break
    deselected = Path(env["MESHTRAIN_DESELECTED"])
    if deselected.exists():
        result.deselected = set(deselected.read_text().split())
    return result


def _read_junit(xml_path: Path, rel: str, test_file: Path, result: FileResult) -> list[str]:
    """Record outcomes; return the node ids skipped only because an earlier test failed."""
    again = []
    for case in ET.parse(xml_path).iter("testcase"):
        cls, test = case.get("classname", "").rsplit(".", 1)[-1], case.get("name", "")
        name = f"{rel.rsplit('/', 1)[-1]}::{cls}::{test}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None and not case.get("classname"):  # the module did not import: none ran
            result.error = _summary(bad.text or bad.get("message") or "")
        elif bad is not None:
            result.failed[name] = _summary(bad.get("message") or bad.text or "")
        elif skip is not None and (skip.get("message") or "").startswith("Previous test failed"):
            again.append(f"{test_file}::{cls}::{test}")
        elif skip is not None:
            result.skipped.add(name)
        else:
            result.passed.add(name)
    return again


def _summary(message: str) -> str:
    """The last informative line of a failure (worker tracebacks bury the error at the end)."""
    lines = [re.sub(r"^E\s+", "", ln.strip()) for ln in message.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception|Warning)\b", ln)]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def skip_reason(name: str) -> str | None:
    """Why `name` ("file::Class::test") is not counted, or None."""
    _, cls, test = name.split("::")
    for suffix, why in SKIP_CLASS_SUFFIXES.items():
        if cls.endswith(suffix):
            return why
    return SKIPS.get(name) or SKIPS.get(f"{cls}::{test}") or SKIPS.get(test) or SKIPS.get(cls)


def report(results: dict[str, dict[str, FileResult]]) -> dict[str, object]:
    per_file, gaps, skipped = {}, [], []
    for rel, sides in results.items():
        theirs, ours = sides["torch"], sides["ours"]
        counted = {n for n in theirs.passed if not skip_reason(n)}
        skipped += sorted(n for n in theirs.passed if skip_reason(n))
        ours_pass = counted & ours.passed
        per_file[rel] = {"torch": len(counted), "ours": len(ours_pass)}
        error = theirs.error or ours.error
        not_run = f"  (not run, SKIPS: {len(theirs.deselected)})" if theirs.deselected else ""
        line = f"{rel:40s} torch {len(counted):4d}  ours {len(ours_pass):4d}{not_run}"
        print(line + (f"  [{error[-300:]}]" if error else ""))
        for name in sorted(counted - ours.passed):
            gaps.append(name)
            print(f"    FAIL {name}: {ours.failed.get(name, 'not run / ' + ours.error[-200:])}")
        for name in sorted(n for n in theirs.passed if skip_reason(n)):
            print(f"    skip {name}: {skip_reason(name)}")
    total_t = sum(v["torch"] for v in per_file.values())
    total_o = sum(v["ours"] for v in per_file.values())
    print(f"{'total':40s} torch {total_t:4d}  ours {total_o:4d}  (skipped as torch internals: {len(skipped)})")
    return {"torch_passed": total_t, "ours_passed": total_o, "per_file": per_file, "failures": gaps, "skipped": skipped}


def _cache_key(rel: str, source: str, keyword: str | None, mode: str) -> str:
    import torch

    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"{rel}|{digest}|{keyword}|{torch.__version__}|{mode}"


def load_cache(path: Path) -> dict[str, dict[str, list[str]]]:
    return json.loads(path.read_text()) if path.exists() else {}


def run_torch_side(workdir: Path, rel: str, source: str, args: argparse.Namespace, cache: dict) -> FileResult:
    """torch's outcomes, reused from the cache when the same source ran on the same torch."""
    key = _cache_key(
        rel, source, args.keyword, f"{'spawn' if args.spawn else 'fork'}|{'all' if args.run_skipped else 'deselect'}"
    )
    hit = cache.get(key)
    # tests deselected then but no longer in SKIPS were never run: the cached outcomes are stale
    if hit is not None and not args.refresh and all(skip_reason(n) for n in hit.get("deselected", [])):
        return FileResult(
            passed=set(hit["passed"]),
            failed=dict(hit["failed"]),
            skipped=set(hit["skipped"]),
            deselected=set(hit.get("deselected", [])),
        )
    result = run_pytest(workdir, "torch", rel, args.keyword, args.timeout)
    if not result.error:
        cache[key] = {
            "passed": sorted(result.passed),
            "failed": result.failed,
            "skipped": sorted(result.skipped),
            "deselected": sorted(result.deselected),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--src", help="a pytorch checkout (holds test/distributed/tensor)")
    src.add_argument("--git-dir", help="a pytorch git dir, read with git show")
    parser.add_argument("--rev", default="v2.13.0", help="revision for --git-dir")
    parser.add_argument("--files", nargs="*", help=f"paths under {TEST_ROOT} (default: every test_*.py there)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per file and side")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "meshtrain" / "torch_public_tests.json",
        help="torch-side outcomes by file, source hash, -k and torch version",
    )
    parser.add_argument("--refresh", action="store_true", help="rerun torch's side even when cached")
    parser.add_argument("--spawn", action="store_true", help="torch's spawned ranks instead of forked ones")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (printed)")
    parser.add_argument("--run-skipped", action="store_true", help="run the SKIPS tests too (not counted)")
    args = parser.parse_args()
    if args.run_skipped:
        os.environ["MESHTRAIN_RUN_SKIPS"] = "1"

    files = args.files or discover_files(args)
    excluded = {rel: EXCLUDED_FILES[rel] for rel in files if rel in EXCLUDED_FILES}
    files = [rel for rel in files if rel not in excluded]
    workdir = Path(tempfile.mkdtemp(prefix="torch_public_tests_"))
    sources = read_sources(args, files)
    prepare(workdir, sources, fork=not args.spawn)
    cache = load_cache(args.cache)
    results = {}
    for rel in files:
        theirs = run_torch_side(workdir, rel, sources[rel], args, cache)
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(cache, indent=1))
        results[rel] = {"torch": theirs, "ours": run_pytest(workdir, "ours", rel, args.keyword, args.timeout)}
        ours = results[rel]["ours"]
        print(f"[{rel}] torch {len(theirs.passed)} ours {len(ours.passed)} passed", file=sys.stderr, flush=True)
    summary = report(results)
    # with discovery, every listed exclusion is reported, found in the source or not
    listed = excluded if args.files else EXCLUDED_FILES
    for rel, why in sorted(listed.items()):
        print(f"excluded {rel}{'' if rel in excluded else ' (not in the source)'}: {why}")
    summary["excluded"] = dict(sorted(listed.items()))
    print(json.dumps(summary))
    if args.keep:
        print(f"sources and junit xml kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
