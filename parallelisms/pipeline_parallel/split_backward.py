"""Split backward for the zero-bubble schedules: I computes the input's gradient now, W the weight gradients
later, without walking the activation path twice (torch pipelining's stage_backward_input / _weight).

The graph from a stage's output has two kinds of nodes: those on the path to the stage's input (the
activation path) and those that lead only to parameters. I runs the activation path and, at every node
where a parameter's branch leaves it (a matmul whose other operand is a weight, say), keeps the gradient
that node received. W starts the engine at each such node with those gradients and asks only for the
parameters of its own branches: the engine then runs those branches and nothing of the activation path
(it skips the outputs no requested input needs; another branch node's parameters, which the activation
path below would reach, are not asked for). A parameter that branches off at two nodes (a weight used
twice in a stage) would be reached from the upper one through the lower: such a stage falls back to one
whole backward in W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from parallelisms.activation_checkpoint import saved_outputs_kept

Node = Any  # torch.autograd.graph.Node (a C++ object without a Python class to annotate)


@dataclass
class WeightGradients:
    """What I leaves for W: each branch node, the parameters its branches reach, and the gradients the
    node received in I."""

    branches: list[tuple[Node, list[torch.Tensor]]]
    received: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # branch index -> grads


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, input: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, WeightGradients | None]:
    """I: the gradient of `input` (a leaf that requires grad) from `output`'s gradient `grad` (None for a
    scalar loss), keeping the graph and what W needs; None instead when W must be one whole backward."""
    branches = _branches(output, input, params)
    pending = None if branches is None else WeightGradients(branches)
    if pending is not None:
        for i, (node, _) in enumerate(pending.branches):
            node.register_prehook(_keep(pending.received, i))
    with saved_outputs_kept():  # W recomputes checkpointed blocks again
        (input_grad,) = torch.autograd.grad(output, [input], grad, retain_graph=True)
    return input_grad, pending


def backward_weight(pending: WeightGradients) -> None:
    """W: the parameters' gradients from the branch nodes' gradients I kept, accumulated into `.grad`."""
    with saved_outputs_kept():  # each branch's grad call recomputes checkpointed blocks anew
        for i, (node, params) in enumerate(pending.branches):
            received = pending.received.get(i, ())
            edges = [GradientEdge(node, slot) for slot, g in enumerate(received) if g is not None]
            if not edges:
                continue
            grads = [g for g in received if g is not None]
            found = torch.autograd.grad(edges, [get_gradient_edge(p) for p in params], grads, allow_unused=True)
            _accumulate(params, found)
    pending.received.clear()


def backward_all_weights(output: torch.Tensor, grad: torch.Tensor | None, params: Sequence[torch.Tensor]) -> None:
    """W as one whole backward from `output` (the first stage, or a weight used at two branch points),
    accumulated into `.grad` as `backward_weight` does: outside the engine's AccumulateGrad, so a data-parallel
    module's gradient hooks see every W alike and its backward is ended once, by the caller."""
    params = list(params)
    found = torch.autograd.grad(output, params, grad, allow_unused=True)
    if params and all(g is None for g in found):
        raise _parameters_not_in_graph()
    _accumulate(params, found)


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def _keep(received: dict[int, tuple[torch.Tensor | None, ...]], index: int):
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        received[index] = tuple(grad_outputs)

    return hook


def _branches(
    output: torch.Tensor, input: torch.Tensor, params: Sequence[torch.Tensor]
) -> list[tuple[Node, list[torch.Tensor]]] | None:
    """The nodes on the activation path (they reach `input`) with next nodes that reach parameters but
    not `input`, each with those parameters; None when a parameter branches off at two nodes. Raises when
    the graph reaches none of `params`: they are not the tensors the forward used."""
    input_node = get_gradient_edge(input).node
    param_of = {get_gradient_edge(p).node: p for p in params}
    reaches_input: dict[Node, bool] = {}
    reached: dict[Node, frozenset[int]] = {}  # ids of the parameters a node off the activation path leads to
    for node in _post_order(output.grad_fn):
        children = [c for c, _ in node.next_functions if c is not None]
        reaches_input[node] = node is input_node or any(reaches_input[c] for c in children)
        own = {id(param_of[node])} if node in param_of else set()
        reached[node] = frozenset(own.union(*(reached[c] for c in children if not reaches_input[c])))
    branches: list[tuple[Node, list[torch.Tensor]]] = []
    claimed: set[int] = set()
    by_id = {id(p): p for p in params}
    for node, on_path in reaches_input.items():
        if not on_path or node is input_node:
            continue
        ids = set().union(*(reached[c] for c, _ in node.next_functions if c is not None and not reaches_input[c]))
        if not ids:
            continue
        if ids & claimed:
            return None
        claimed |= ids
        branches.append((node, [by_id[i] for i in ids]))
    if params and not claimed:
        raise _parameters_not_in_graph()
    return branches


def _parameters_not_in_graph() -> RuntimeError:
    return RuntimeError(
        "split backward: none of the stage's parameters is in its forward's graph, so W would compute no weight "
        "gradient; the module swapped them after forward (fully_shard with reshard_after_forward=True registers "
        "the sharded ones): keep them gathered until W (reshard_after_forward=False, the trainer's "
        "parallelism.fsdp_reshard_after_forward='default' under PP)"
    )


def _post_order(root: Node) -> list[Node]:
    """Every node reachable from `root`, each after the nodes it leads to."""
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    seen: set[Node] = set()
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return order
