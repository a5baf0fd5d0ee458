"""Split backward (I then W): the gradients of one backward, with the activation path run once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelisms.activation_checkpoint import checkpoint_module
from parallelisms.pipeline_parallel.split_backward import backward_input, backward_weight


class CountedIdentity(torch.autograd.Function):
    """The identity, counting its backward calls: it sits on the activation path only."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        CountedIdentity.calls += 1
        return grad


class Block(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CountedIdentity.apply(self.norm(x))
        y = x + self.down(torch.relu(self.up(h)))
        return self.down(torch.relu(self.up(y))) if self.shared else y  # a weight used at two branch points


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _check(shared: bool, ac: str = "none") -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(shared), Block())
    if ac != "none":
        for block in model:
            checkpoint_module(block, selective=ac == "selective")
    x = torch.randn(4, 8)
    out_grad = torch.randn(4, 8)
    whole_input = x.clone().requires_grad_()
    model(whole_input).backward(out_grad)
    want, want_input = _grads(model), whole_input.grad
    model.zero_grad(set_to_none=True)

    split_input = x.clone().requires_grad_()
    out = model(split_input)
    CountedIdentity.calls = 0
    input_grad, pending = backward_input(out, out_grad, split_input, list(model.parameters()))
    in_i = CountedIdentity.calls
    assert all(p.grad is None for p in model.parameters())  # I leaves the weights alone
    if pending is None:  # a weight at two branch points: W is one whole backward
        torch.autograd.backward(out, out_grad, inputs=list(model.parameters()))
    else:
        backward_weight(pending)
    torch.testing.assert_close(input_grad, want_input, rtol=0, atol=0)
    got = _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    return in_i, CountedIdentity.calls - in_i


def test_split_backward_gives_one_backwards_gradients_and_w_skips_the_activation_path() -> None:
    in_i, in_w = _check(shared=False)
    assert (in_i, in_w) == (2, 0)  # both blocks' activation paths run in I, none of them in W


def test_a_weight_used_at_two_branch_points_falls_back_to_one_whole_backward() -> None:
    in_i, in_w = _check(shared=True)
    assert in_i == 2 and in_w == 2


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_split_backward_through_checkpointed_blocks_recomputes_them_for_w(ac: str) -> None:
    # W recomputes a checkpointed block a second time; op-level selective checkpointing used to refuse that
    # ("Trying to backward an extra time") because torch's replay hands each saved output out only once.
    in_i, in_w = _check(shared=False, ac=ac)
    assert (in_i, in_w) == (2, 0)


def test_outside_a_split_backward_selective_checkpointing_releases_its_saved_outputs_as_torch() -> None:
    # Only I keeps them (for W): a whole backward releases each as it replays it, so a second one is refused.
    block = checkpoint_module(Block(), selective=True)
    out = block(torch.randn(4, 8, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        out.backward()
