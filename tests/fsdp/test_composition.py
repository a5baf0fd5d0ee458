"""FSDP x TP composition matrix: one training program (tests/fsdp/small_llama.py), every layout, two backends.

`train(backend, layout)` runs a small Llama with torchtitan's TP plan and FSDP wrapping on a world of
`world_size(layout)` ranks, on torch's DeviceMesh / fully_shard / tensor parallel (the oracle) or on
ours; `reference()` trains the same model on one process with the whole global batch. Each
(backend, layout) pair trains once per session (results are cached); the tests compare per-step
losses, gradient norms and final full parameters with the reference, and our collectives with
torch's.

Collectives are metered twice per run: step COUNTED_STEP by the backend's own CommDebugMode, step
BYTES_STEP (same pattern: optimizer state exists from step 1 on) by our CommDebugMode for both
backends, which also measures bytes and keys torch's c10d ops by their functional names, so ours and
torch's compare on one meter. test_meters_agree checks that meter against torch's own on torch's run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.fsdp import small_llama as sl
from tests.world import run_world

LAYOUTS = list(sl.LAYOUTS)
BACKENDS = ["torch", "ours"]

# fp32 throughout. Torch's runs differ from the reference by <= 5e-7 in losses and <= 2e-7 in
# parameters (summation order: sharded reductions, reduce-scatter averaging, 2 sequential
# all-reduces for the clip norm); the tolerance leaves ~10x headroom and is still far below what a
# wrong gradient, a missed reduction or a dropped clip would move (>= 1e-3 after 5 AdamW steps).
TOL = dict(rtol=1e-5, atol=1e-6)

# torch's CommDebugMode keys the c10d ops FSDP2 calls by their own names; ours by functional names
_C10D_TO_FUNCTIONAL = {
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "alltoall_base_": "all_to_all_single",
    "broadcast_": "broadcast",
}

_RESULTS: dict[tuple[str, str], list[dict] | BaseException] = {}
_REFERENCE: list[dict] = []


def _timeout(layout: str) -> float:
    # torch's run takes ~1-4 s on 2-4 ranks and ~20 s on 8 (2 cores); a hang must not eat the suite
    return 120.0 if sl.world_size(layout) > 4 else 60.0


def results(backend: str, layout: str) -> list[dict]:
    """Every rank's `train(backend, layout)`, run once per session (a failure is re-raised, not rerun)."""
    key = (backend, layout)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = run_world(sl.train, sl.world_size(layout), backend, layout, timeout=_timeout(layout))
        except Exception as e:  # cached: the comm tests must not rerun a failed run
            _RESULTS[key] = e
    got = _RESULTS[key]
    if isinstance(got, BaseException):
        raise got
    return got


def reference() -> dict:
    if not _REFERENCE:
        _REFERENCE.append(sl.reference())
    return _REFERENCE[0]


def _normalized(counts: dict[str, int]) -> Counter:
    out: Counter = Counter()
    for k, n in counts.items():
        out[_C10D_TO_FUNCTIONAL.get(k, k)] += n
    return out


def test_backends_offer_the_same_names() -> None:
    torch_ns, ours_ns = sl.namespace("torch"), sl.namespace("ours")
    assert vars(torch_ns).keys() == vars(ours_ns).keys()
    assert all(ours_ns.__dict__[n].__module__.startswith("parallelisms.") for n in vars(ours_ns))
    assert all(torch_ns.__dict__[n].__module__.startswith("torch.") for n in vars(torch_ns))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_trains_like_one_process(backend: str, layout: str) -> None:
    ref = reference()
    for rank, r in enumerate(results(backend, layout)):
        assert r["all_dtensor"], f"rank {rank}: some parameters are not DTensors: {r['placements']}"
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], **TOL, msg=lambda m: f"grad norms: {m}")
        torch.testing.assert_close(r["losses"], ref["losses"], **TOL, msg=lambda m: f"losses: {m}")
        assert r["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            where = f"rank {rank} {name} {r['placements'].get(name)}"
            torch.testing.assert_close(r["params"][name], want, **TOL, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_meters_agree(layout: str) -> None:
    """On torch's run, our CommDebugMode (step BYTES_STEP) counts what torch's (step COUNTED_STEP) does."""
    for r in results("torch", layout):
        assert "meter_error" not in r, r["meter_error"]
        assert _normalized(r["comm_counts"]) == Counter(r["comm_counts_ours_meter"]), (
            r["comm_counts"],
            r["comm_counts_ours_meter"],
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_collectives_not_more_than_torch(layout: str) -> None:
    """One training step (forward, backward, clip, AdamW) on every rank: per kind and in total,
    no more collectives than torch's, on one meter."""
    for ours, theirs in zip(results("ours", layout), results("torch", layout)):
        o, t = Counter(ours["comm_counts_ours_meter"]), Counter(theirs["comm_counts_ours_meter"])
        assert sum(o.values()) <= sum(t.values()), (o, t)
        assert all(n <= t[k] for k, n in o.items()), (o, t)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_not_more_than_torch(layout: str) -> None:
    """The same step: no more bytes handed to collectives in total than torch's."""
    for ours, theirs in zip(results("ours", layout), results("torch", layout)):
        o, t = ours["comm_bytes"], theirs["comm_bytes"]
        assert sum(o.values()) <= sum(t.values()), (o, t)
