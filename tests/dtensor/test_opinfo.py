"""torch's OpInfo database through our DTensor on a (2,) mesh: how many ops give the single-device
result with every tensor input sharded on dim 0 (replicated where it has no dim 0), or refuse a strict view
exactly as torch's DTensor does.

The set of passing ops is recorded in opinfo_baseline.json; it may only grow. After adding rules,
refresh it with `MESHTRAIN_UPDATE_OPINFO=1 python -m pytest tests/dtensor/test_opinfo.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from tests.dtensor.harness import torch_refuses_alike
from tests.world import run_world

BASELINE = Path(__file__).with_name("opinfo_baseline.json")
SAMPLES_PER_OP = 2
SKIP_WORDS = (
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "multinomial",
    "uniform",
    "poisson",
    "empty",
    "cauchy",
    "exponential",
    "geometric",
    "log_normal",
    "sparse",
    "jiterator",
    "nonzero_static",
    "svd",
    "eig",
    "lu",
    "lstsq",
    "qr",
    "cholesky",
    "pinv",
    "solve",
    "inv",
    "fft",
    "histogram",
    "unique",
    "bincount",
    "masked_select",
    "nonzero",
    "item",
)


def _agree(ok: bool) -> bool:
    """True only if every rank succeeded (keeps ranks in lockstep after a local failure)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _check_sample(opinfo, sample, mesh) -> bool:
    from parallelisms.dtensor import DTensor, Replicate, Shard, distribute_tensor

    args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
    expected = opinfo.op(*args, **kwargs)

    def shard(t):
        if not isinstance(t, torch.Tensor):
            return t
        placement = Shard(0) if t.ndim and t.shape[0] >= 2 else Replicate()
        return distribute_tensor(t.detach().clone(), mesh, [placement])

    ok, refused = True, False
    d_args, d_kwargs = tree_map(shard, args), tree_map(shard, kwargs)
    try:
        got = opinfo.op(*d_args, **d_kwargs)
    except Exception as e:
        ok = False
        refused = torch_refuses_alike(opinfo.op, d_args, d_kwargs, e)  # a strict view, refused as torch's
    if not _agree(ok):
        return _agree(refused)
    got_leaves, _ = tree_flatten(got)
    want_leaves, _ = tree_flatten(expected)
    fulls = [g.full_tensor() if isinstance(g, DTensor) else g for g in got_leaves]
    try:
        assert len(fulls) == len(want_leaves)
        for g, w in zip(fulls, want_leaves):
            if isinstance(w, torch.Tensor):
                torch.testing.assert_close(g, w, equal_nan=True, atol=1e-4, rtol=1e-4, check_stride=False)
            else:
                assert g == w or (g != g and w != w)
    except Exception:
        ok = False
    return _agree(ok)


def _run_op_db() -> list[str]:
    from torch.testing._internal.common_methods_invocations import op_db

    from tests.dtensor.harness import get_mesh

    mesh = get_mesh((2,))
    passing = []
    for opinfo in op_db:
        name = f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name
        if any(w in name for w in SKIP_WORDS) or torch.float32 not in opinfo.supported_dtypes("cpu"):
            continue
        torch.manual_seed(0)
        samples = []
        try:
            for i, s in enumerate(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)):
                if i >= SAMPLES_PER_OP:
                    break
                samples.append(s)
        except Exception:
            continue
        if samples and all(_check_sample(opinfo, s, mesh) for s in samples):
            passing.append(name)
    return passing


def test_opinfo_pass_count_never_drops():
    passing = run_world(_run_op_db, 2, timeout=900)[0]
    baseline = set(json.loads(BASELINE.read_text())["passing"]) if BASELINE.exists() else set()
    print(f"OpInfo ops passing on a (2,) mesh with S(0) inputs: {len(passing)} (baseline {len(baseline)})")
    if os.environ.get("MESHTRAIN_UPDATE_OPINFO") == "1":
        BASELINE.write_text(json.dumps({"count": len(passing), "passing": sorted(passing)}, indent=1) + "\n")
    lost = sorted(baseline - set(passing))
    assert not lost, f"{len(lost)} OpInfo ops that used to pass now fail: {lost}"
