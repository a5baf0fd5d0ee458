"""Tensor-parallel styles against one device and against torch's own tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.world import run_world


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class Tiny(nn.Module):
    """Embedding -> norm -> MLP -> norm -> output: the shape of a Llama TP/SP plan."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        h = h + self.mlp(self.norm1(h))
        return self.out(self.norm2(h))


def _mlp_plan(impl):
    return {"fc1": impl.ColwiseParallel(), "fc2": impl.RowwiseParallel()}


def _sp_plan(impl, R, S):
    return {
        "tok": impl.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
        "norm1": impl.SequenceParallel(),
        "mlp": impl.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R(),)),
        "mlp.fc1": impl.ColwiseParallel(),
        "mlp.fc2": impl.RowwiseParallel(output_layouts=S(1)),
        "norm2": impl.SequenceParallel(),
        "out": impl.ColwiseParallel(input_layouts=S(1), output_layouts=R()),
    }


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _run_mlp(tp: int) -> dict:
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    import parallelisms.tensor_parallel as ours
    from parallelisms.dtensor.debug import CommDebugMode
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    ref = MLP()
    models = {}
    for name, impl, mesh in (("ours", ours, get_mesh((tp,))), ("torch", torch_tp, get_torch_mesh((tp,)))):
        torch.manual_seed(0)
        models[name] = impl.parallelize_module(MLP(), mesh, _mlp_plan(impl))
    ref(x).pow(2).sum().backward()
    counts = {}
    for name, model in models.items():
        with CommDebugMode() if name == "ours" else TorchCommDebugMode() as cm:
            out = model(x)
            out.pow(2).sum().backward()
        counts[name] = cm.get_total_counts()
        torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)
        for k, g in _grads(model).items():
            torch.testing.assert_close(g, dict(ref.named_parameters())[k].grad, atol=1e-5, rtol=1e-5)
    return counts


def test_colwise_rowwise_mlp_matches_single_device_and_torch_comms():
    for tp in (2, 4):
        counts = run_world(_run_mlp, tp, tp)[0]
        assert counts["ours"] <= counts["torch"], counts


def _run_sequence_parallel(tp: int) -> dict:
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    import parallelisms.tensor_parallel as ours
    from parallelisms.dtensor import Replicate, Shard
    from parallelisms.dtensor.debug import CommDebugMode
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    ref = Tiny()
    ref_out = ref(idx)
    ref_out.pow(2).mean().backward()
    counts = {}
    for name, impl, mesh, R, S in (
        ("ours", ours, get_mesh((tp,)), Replicate, Shard),
        ("torch", torch_tp, get_torch_mesh((tp,)), TR, TS),
    ):
        torch.manual_seed(0)
        model = impl.parallelize_module(Tiny(), mesh, _sp_plan(impl, R, S))
        with CommDebugMode() as cm:  # ours counts any collective, so both are measured alike
            out = model(idx)
            out.pow(2).mean().backward()
        counts[name] = cm.get_total_counts()
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for k, g in _grads(model).items():
            want = dict(ref.named_parameters())[k].grad
            torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5, msg=lambda m, k=k, name=name: f"{name} {k}: {m}")
    return counts


def test_sequence_parallel_plan_matches_single_device_and_torch_comms():
    counts = run_world(_run_sequence_parallel, 2, 2)[0]
    assert counts["ours"] <= counts["torch"], counts
