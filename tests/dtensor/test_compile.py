"""torch.compile(fullgraph=True) over our DTensor (parallelisms/dtensor/traceable.py): from_local, redistribute,
to_local and full_tensor inside a compiled region give eager's values and gradients; the graph AOT autograd
hands the backend holds functional collectives with their waits and plain tensors only; a second call with
new values does not recompile; meshes and placements are guarded on.

The backend records AOT autograd's graphs with eager kernels ("aot_eager"), so the values are eager's bit for
bit; one case runs inductor as well.
"""

from __future__ import annotations

import shutil
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard
from tests.dtensor.harness import get_mesh
from tests.world import run_world


class _Recorder:
    """An aot_eager backend that notes every op AOT autograd's forward and backward graphs call."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.graphs = 0
        self.backend = aot_autograd(fw_compiler=self._note, bw_compiler=self._note)

    def _note(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.ops[str(node.target)] += 1
            assert not any(type(v).__name__ == "DTensor" for v in node.meta.values()), "a DTensor reached the backend"
        return make_boxed_func(gm.forward)


def _program(mesh, x: torch.Tensor, w: DTensor) -> torch.Tensor:
    """Every entry point and the four collectives: S->R all-gather, P->R all-reduce, P->S reduce-scatter,
    S(0)->S(1) all-to-all, on shapes that do not divide evenly."""
    d = DTensor.from_local(x, mesh, [Replicate()])
    y = torch.nn.functional.linear(d, w)  # (3, 5) on S(1): uneven
    gathered = y.redistribute(mesh, [Replicate()])  # all-gather, padded
    z = torch.nn.functional.linear(gathered, w.redistribute(mesh, [Shard(1)]).t())  # partial sums of (3, 4)
    summed = z.redistribute(mesh, [Replicate()])  # all-reduce
    scattered = (z * 1.0).redistribute(mesh, [Shard(0)])  # reduce-scatter of 3 rows over 2 ranks
    moved = y.redistribute(mesh, [Shard(0)])  # all-to-all
    partial = DTensor.from_local(x * 0.5, mesh, [Partial()]).full_tensor()
    return (
        gathered.to_local().relu().sum()
        + summed.to_local().square().sum()
        + scattered.full_tensor().sum()
        + moved.full_tensor().tanh().sum()
        + partial.sum()
    )


def compiled_matches_eager(backends: tuple[str, ...]) -> dict[str, Any]:
    mesh = get_mesh((2,))
    rank = dist.get_rank()
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))  # 5 rows: uneven over 2 ranks
    rows = weight[:3] if rank == 0 else weight[3:]
    results: dict[str, Any] = {}
    for backend_name in backends:
        recorder = _Recorder()
        backend = recorder.backend if backend_name == "aot_eager" else "inductor"
        compiled = torch.compile(_program, backend=backend, fullgraph=True)
        for call in range(2):  # the second call, new values, must reuse the graph
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + call))
            grads = []
            for fn in (compiled, _program):
                xi = x.clone().requires_grad_()
                w = DTensor.from_local(rows.clone(), mesh, [Shard(0)], shape=(5, 4), stride=(4, 1)).requires_grad_()
                out = fn(mesh, xi, w)
                out.backward()
                grads.append((out.detach(), xi.grad, w.grad.to_local()))
            (got, gx, gw), (want, ex, ew) = grads
            exact = backend_name == "aot_eager"
            tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(gx, ex, **tol)
            torch.testing.assert_close(gw, ew, **tol)
        if backend_name == "aot_eager":
            results["graphs"] = recorder.graphs
            results["ops"] = recorder.ops
    return results


def test_dtensor_programs_compile_whole_with_eager_values() -> None:
    ranks = run_world(compiled_matches_eager, 2, ("aot_eager",))
    graphs, ops = ranks[0]["graphs"], ranks[0]["ops"]
    assert graphs == 2, f"one forward and one backward graph, compiled once for both calls; got {graphs}"
    collectives = {k: v for k, v in ops.items() if k.startswith("_c10d_functional.")}
    for name in ("all_gather_into_tensor", "all_reduce", "all_to_all_single"):  # gloo's reduce-scatter: all-to-all
        assert collectives.get(f"_c10d_functional.{name}.default"), (name, collectives)
    issued = sum(v for k, v in collectives.items() if not k.startswith("_c10d_functional.wait_tensor"))
    assert collectives["_c10d_functional.wait_tensor.default"] == issued, collectives  # every collective waited


@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")), reason="inductor's CPU kernels need a C++ compiler"
)
def test_inductor_compiles_the_same_program() -> None:
    """Generated C++ kernels around the functional collectives: eager's values within 1e-5 (a minute on 2 cores,
    most of it compiling the kernels once)."""
    run_world(compiled_matches_eager, 2, ("inductor",), timeout=600.0)


def guards_on_placements() -> list[int]:
    """A new placement or mesh recompiles (it is a constant of the graph); the same ones do not."""
    mesh, mesh2 = get_mesh((2,)), get_mesh((1, 2))
    counts: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        counts.append(1)
        return gm.forward

    def f(local: torch.Tensor, m, placements) -> torch.Tensor:
        return DTensor.from_local(local, m, placements).full_tensor() * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    local = torch.arange(4.0) + dist.get_rank()
    want = torch.cat([torch.arange(4.0), torch.arange(4.0) + 1]) * 2
    assert torch.equal(compiled(local, mesh, [Shard(0)]), want)
    assert torch.equal(compiled(local + 0, mesh, [Shard(0)]), want)  # same constants: no recompile
    assert torch.equal(compiled(local, mesh, [Partial()]), (torch.arange(4.0) * 2 + 1) * 2)  # new placement
    assert torch.equal(compiled(local, mesh2, [Replicate(), Shard(0)]), want)  # new mesh
    return [len(counts)]


def test_meshes_and_placements_are_guarded_constants() -> None:
    assert run_world(guards_on_placements, 2)[0] == [3]


def test_a_block_that_does_not_compile_is_an_error_naming_it() -> None:
    """No silent fall back to eager: the block, the reason and the way out, in one line."""
    from parallelisms.dtensor.traceable import compile_whole

    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(RuntimeError, match=r"torch.compile of layers.3 failed \(Unsupported: .*compile.enable=false"):
        compile_whole(breaks, "eager", "layers.3")(torch.ones(2))
