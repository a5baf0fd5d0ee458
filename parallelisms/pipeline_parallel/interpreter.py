"""The interpreter: runs one rank's lowered action list (`lowering.lower_schedule`) over its stages.

One step of a schedule, for every microbatch m of every local stage s:
    RECV_F  post the receive of s's input from stage s-1's rank      (waited by the F that reads it)
    F       s's forward on its input (the microbatch on stage 0); the last stage computes the loss
    SEND_F  post the send of s's output to stage s+1's rank
    RECV_B  post the receive of the gradient of s's output             (waited by the B that reads it)
    B       s's backward from that gradient (from the loss on the last stage); frees m's activations
    SEND_B  post the send of the gradient of s's input to stage s-1's rank
Adjacent stages on the same rank (interleaved and V placements) hand tensors over directly: the lowering
puts no transfer between them. Sends and receives are posted when their action comes and waited where the
data is needed (sends at the end of the step): the order every rank posts them in is the schedule's,
which the simulator has checked cannot deadlock. Each microbatch's activations are freed as soon as its
backward has run, so 1F1B holds at most pp microbatches per stage.

Split backward (zero-bubble schedules): I computes the input's gradient only and keeps the gradients at
the nodes where the weight branches leave the activation path; W computes the weight gradients from those
(split_backward.py), so the activation path runs once. On the first stage, whose input needs no gradient,
I does nothing and W is the whole backward.

Data parallelism inside a stage (FSDP, DDP) works through the module's own hooks. Every backward of the step
runs without gradient sync and, under FSDP, keeps the parameters unsharded, except the stage's last weight
backward of the step (its last B or W), which reduces the accumulated gradients once and reshards. W
accumulates the weight gradients itself (autograd .grad, not the engine's AccumulateGrad, whose hooks would
end a backward per branch), so after the last W the runtime ends the backward explicitly: the module's
`finish_backward()`. A list lowered with the FSDP actions (`lower_schedule(unshard_reshard=True,
reduce_grad=True)`, torch's lowering) says when instead:
    UNSHARD     start gathering the stage's parameters (waited before the stage next computes)
    RESHARD     free them
    REDUCE_GRAD reduce the gradients the stage's backwards accumulated (every backward then runs without
                sync and keeps the parameters: the actions decide)
On a stage without FSDP, UNSHARD and RESHARD do nothing; REDUCE_GRAD reduces a DDP stage's buckets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .actions import Action, ActionKind
from .p2p import PendingRecv, PendingSend, Transfers
from .split_backward import WeightGradients, backward_all_weights, backward_input, backward_weight
from .stage import PipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, target) -> loss
_P2P = {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
_COMPUTE = {ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W}


@dataclass
class _Activations:
    """What one microbatch left on one stage until its backward: freed once the weight gradients are in
    (B, or W after I) and the input's gradient has gone back (sent, taken by the local previous stage, or
    not needed on the first stage)."""

    input: torch.Tensor | None = None  # requires grad on stages > 0: its gradient goes back a stage
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None  # kept from I for W (the first stage's: W is its whole backward)
    weight_grads: WeightGradients | None = None  # kept from I for W (the other stages)
    weights_done: bool = False
    grad_gone: bool = False


@dataclass
class StepResult:
    """Per microbatch, the loss the last stage computed (empty on ranks without the last stage)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    peak_live_microbatches: dict[int, int] = field(default_factory=dict)  # stage -> most activations held
    p2p_batches: int = 0  # batch_isend_irecv calls: one per run of consecutive transfers


@dataclass
class _StepState:
    """What one step's actions hand each other: activations, pending transfers, losses."""

    inputs: Sequence[torch.Tensor] | None
    targets: Sequence[torch.Tensor] | None
    sync_grads: bool
    last_weights: dict[int, int]  # stage -> index of the action that completes its weight gradients
    module_kwargs: Sequence[dict[str, Any]] | None = None  # per microbatch, for every stage's module
    live: dict[tuple[int, int], _Activations] = field(default_factory=dict)  # (stage, microbatch)
    recvs: dict[tuple[int, ActionKind, int], PendingRecv] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)  # posted, not known to be finished
    transfers: Transfers = field(default_factory=Transfers)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> the last stage's loss
    peak_live: dict[int, int] = field(default_factory=dict)
    unshards: dict[int, Any] = field(default_factory=dict)  # stage -> its UNSHARD's handle, until it computes


def _microbatch(action: Action) -> int:
    assert action.microbatch is not None, f"{action}: a per-microbatch action without a microbatch"
    return action.microbatch


class PipelineSchedule:
    """Runs `actions` (this rank's lowered list) over `stages` (this rank's stages) once per `step`."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        actions: Sequence[Action],
        loss_fn: LossFn,
        *,
        loss_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """`loss_context`: entered around the last stage's loss and its backward (TP's loss_parallel)."""
        self.loss_context = loss_context or contextlib.nullcontext
        self.stages = {s.stage_index: s for s in stages}
        self.actions, self.loss_fn = list(actions), loss_fn
        missing = sorted({a.stage for a in actions} - set(self.stages))
        if missing:
            raise ValueError(f"the schedule runs stages {missing}, which this rank does not hold")
        # with REDUCE_GRAD in the list, it (not the stage's last backward) reduces: one per stage that computes
        self.explicit_reduce = any(a.kind is ActionKind.REDUCE_GRAD for a in self.actions)
        if self.explicit_reduce:
            _check_one_reduce_per_stage(self.actions)
        self._handlers: dict[ActionKind, Callable[[_StepState, int, Action], None]] = {
            ActionKind.RECV_F: self._on_recv, ActionKind.RECV_B: self._on_recv,
            ActionKind.F: self._on_forward, ActionKind.SEND_F: self._on_send_forward,
            ActionKind.B: self._on_backward, ActionKind.I: self._on_backward,
            ActionKind.W: self._on_weight_backward, ActionKind.SEND_B: self._on_send_backward,
            ActionKind.UNSHARD: self._on_unshard, ActionKind.RESHARD: self._on_reshard,
            ActionKind.REDUCE_GRAD: self._on_reduce_grad,
        }  # fmt: skip

    def step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        *,
        sync_grads: bool = True,
        module_kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> StepResult:
        """One forward and backward of every microbatch. `inputs` (the first stage's rank) and `targets` (the
        last stage's rank) hold one tensor per microbatch; the gradients accumulate in the stages' parameters.
        `module_kwargs` (every rank): per microbatch, keyword arguments of every stage's forward (e.g. the
        document ids of block-causal attention, which the later stages cannot read from hidden states).

        A stage whose module reduces gradients across data-parallel ranks (FSDP, DDP:
        `set_requires_gradient_sync`) reduces them once, in its last backward of the step, with `sync_grads`
        (torch's REDUCE_GRAD), and not at all without (gradient accumulation over several steps' calls)."""
        last_weights = {} if self.explicit_reduce else _last_weight_actions(self.actions)
        state = _StepState(inputs, targets, sync_grads, last_weights, module_kwargs)
        for index, action in enumerate(self.actions):
            if action.kind not in _P2P:
                state.transfers.post()  # the run of transfers before this compute, as one batch
                state.sends = [send for send in state.sends if not send.completed()]  # free what finished sending
            if action.kind in _COMPUTE and (gathering := state.unshards.pop(action.stage, None)) is not None:
                gathering.wait()
            self._handlers[action.kind](state, index, action)
        state.transfers.post()
        for send in state.sends:
            send.wait()
        if state.live or state.recvs:
            raise RuntimeError(
                f"the schedule left (stage, microbatch) activations {sorted(state.live)} and receives "
                f"{sorted((s, k.value, m) for s, k, m in state.recvs)} unconsumed: it is not a whole step"
            )
        return StepResult(
            losses=[state.losses[m] for m in sorted(state.losses)],
            peak_live_microbatches=state.peak_live,
            p2p_batches=state.transfers.batches,
        )

    # ---- one handler per action kind: (step state, the action's index in the list, the action)

    def _on_recv(self, state: _StepState, index: int, action: Action) -> None:
        stage, s = self.stages[action.stage], action.stage
        forward = action.kind is ActionKind.RECV_F
        meta, peer = (stage.input_meta, s - 1) if forward else (stage.output_meta, s + 1)
        assert meta is not None
        state.recvs[s, action.kind, _microbatch(action)] = state.transfers.recv(
            meta, stage.peer(peer), stage.device, stage.process_group
        )

    def _on_forward(self, state: _StepState, index: int, action: Action) -> None:
        s, m = action.stage, _microbatch(action)
        acts = state.live.setdefault((s, m), _Activations())
        self._forward(self.stages[s], m, acts, state.live, state.recvs, state.inputs, state.targets,
                      state.module_kwargs)  # fmt: skip
        held = sum(1 for key in state.live if key[0] == s)
        state.peak_live[s] = max(state.peak_live.get(s, 0), held)

    def _on_send_forward(self, state: _StepState, index: int, action: Action) -> None:
        stage, s, m = self.stages[action.stage], action.stage, _microbatch(action)
        output = state.live[s, m].output
        assert output is not None
        state.sends.append(state.transfers.send(output.detach(), stage.peer(s + 1), stage.process_group))

    def _on_backward(self, state: _StepState, index: int, action: Action) -> None:
        """B, or I (the input's gradient only) in the split-backward schedules."""
        stage, m = self.stages[action.stage], _microbatch(action)
        _set_gradient_sync(stage.module, state.sync_grads, last=index == state.last_weights.get(action.stage))
        loss = self._backward(stage, m, state.live, state.recvs, weights=action.kind is ActionKind.B)
        if loss is not None:
            state.losses[m] = loss

    def _on_weight_backward(self, state: _StepState, index: int, action: Action) -> None:
        stage = self.stages[action.stage]
        _set_gradient_sync(stage.module, state.sync_grads, last=False)  # its hooks (FSDP's pre-backward) only stash
        self._weight_backward(stage, _microbatch(action), state.live)
        if index == state.last_weights.get(action.stage):
            _finish_weight_backward(stage.module, state.sync_grads)

    def _on_send_backward(self, state: _StepState, index: int, action: Action) -> None:
        stage, s, m = self.stages[action.stage], action.stage, _microbatch(action)
        acts = state.live[s, m]
        assert acts.input_grad is not None, f"stage {s} microbatch {m}: SEND_B before its B or I"
        state.sends.append(state.transfers.send(acts.input_grad, stage.peer(s - 1), stage.process_group))
        acts.grad_gone = True
        _release(state.live, s, m)

    def _on_unshard(self, state: _StepState, index: int, action: Action) -> None:
        unshard = getattr(self.stages[action.stage].module, "unshard", None)  # FSDP's; nothing to gather otherwise
        if unshard is not None:
            state.unshards[action.stage] = unshard(async_op=True)

    def _on_reshard(self, state: _StepState, index: int, action: Action) -> None:
        gathering = state.unshards.pop(action.stage, None)
        if gathering is not None:  # gathered and never used: land it before freeing it
            gathering.wait()
        reshard = getattr(self.stages[action.stage].module, "reshard", None)
        if reshard is not None:
            reshard()

    def _on_reduce_grad(self, state: _StepState, index: int, action: Action) -> None:
        _finish_weight_backward(self.stages[action.stage].module, state.sync_grads)

    @torch.no_grad()
    def forward_only(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        *,
        module_kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> list:
        """Evaluation: the schedule's forwards and their transfers only (the order stays deadlock-free: only
        waits are removed), without gradients; each microbatch's activations are dropped once passed on.
        Returns the last stage's per-microbatch losses (empty elsewhere). `module_kwargs`: as `step`'s."""
        state = _StepState(inputs, targets, sync_grads=False, last_weights={}, module_kwargs=module_kwargs)
        for action in self.actions:
            if action.kind is ActionKind.RECV_F:
                self._on_recv(state, 0, action)
            elif action.kind is ActionKind.F:
                state.transfers.post()
                stage, s, m = self.stages[action.stage], action.stage, _microbatch(action)
                acts = state.live.setdefault((s, m), _Activations())
                self._forward(stage, m, acts, state.live, state.recvs, inputs, targets, module_kwargs)
                if not stage.is_first and stage.is_local(s - 1):
                    state.live.pop((s - 1, m))  # handed over
                if stage.is_last:
                    assert acts.loss is not None
                    state.losses[m] = acts.loss
                    state.live.pop((s, m))
            elif action.kind is ActionKind.SEND_F:
                stage, m = self.stages[action.stage], _microbatch(action)
                output = state.live.pop((action.stage, m)).output
                assert output is not None
                state.sends.append(state.transfers.send(output, stage.peer(action.stage + 1), stage.process_group))
        state.transfers.post()
        for send in state.sends:
            send.wait()
        return [state.losses[m] for m in sorted(state.losses)]

    def _forward(
        self, stage: PipelineStage, m: int, acts: _Activations, live: dict, recvs: dict,
        inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None,
        module_kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        s = stage.stage_index
        if stage.is_first:
            assert inputs is not None, "the first stage's rank needs the microbatch inputs"
            x = inputs[m]
        elif stage.is_local(s - 1):  # the previous stage is ours: hand its output over, cut from its graph
            x = live[s - 1, m].output.detach().requires_grad_()
        else:
            x = recvs.pop((s, ActionKind.RECV_F, m)).wait().requires_grad_()
        acts.input = x
        out = stage.module(x, **(module_kwargs[m] if module_kwargs is not None else {}))
        if stage.is_last:
            assert targets is not None, "the last stage's rank needs the microbatch targets"
            with self.loss_context():
                acts.loss = self.loss_fn(out, targets[m])
        else:
            acts.output = out

    def _backward(self, stage: PipelineStage, m: int, live: dict, recvs: dict, *, weights: bool) -> torch.Tensor | None:
        """Stage s's backward of microbatch m: B (input and weight gradients) or, without `weights`, I (the
        input's gradient only, keeping the graph for W). Returns the loss on the last stage."""
        s = stage.stage_index
        acts = live[s, m]
        loss, grad = None, None
        if stage.is_last:
            assert acts.loss is not None
            loss, target = acts.loss.detach(), acts.loss
        else:
            if stage.is_local(s + 1):  # the next stage is ours: its input's gradient is this one's output's
                nxt = live[s + 1, m]
                grad, nxt.grad_gone = nxt.input_grad, True
                _release(live, s + 1, m)
            else:
                grad = recvs.pop((s, ActionKind.RECV_B, m)).wait()
            assert acts.output is not None and grad is not None
            target = acts.output
        with self.loss_context() if stage.is_last else contextlib.nullcontext():
            if weights:
                torch.autograd.backward(target, grad)
                acts.input_grad = None if stage.is_first else acts.input.grad
                acts.output = acts.loss = None  # the graph is gone
                acts.weights_done = True
            elif stage.is_first:
                acts.output_grad = grad
            else:
                acts.input_grad, acts.weight_grads = backward_input(target, grad, acts.input, _params(stage))
                acts.output_grad = grad if acts.weight_grads is None else None  # W walks it all again
        acts.grad_gone = acts.grad_gone or stage.is_first
        _release(live, s, m)
        return loss

    def _weight_backward(self, stage: PipelineStage, m: int, live: dict) -> None:
        """W: the weight gradients of stage s's microbatch m, from the graph and output gradient its I kept."""
        s = stage.stage_index
        acts = live[s, m]
        target = acts.loss if stage.is_last else acts.output
        assert target is not None, f"stage {s} microbatch {m}: W before its I"
        with self.loss_context() if stage.is_last else contextlib.nullcontext():
            if acts.weight_grads is not None:
                backward_weight(acts.weight_grads)
            else:
                backward_all_weights(target, acts.output_grad, _params(stage))
        acts.output = acts.loss = acts.output_grad = acts.weight_grads = None
        acts.weights_done = True
        _release(live, s, m)


def _last_weight_actions(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage, the index of the action that completes its weight gradients for the step (its last B or W)."""
    return {a.stage: i for i, a in enumerate(actions) if a.kind in (ActionKind.B, ActionKind.W)}


def _check_one_reduce_per_stage(actions: Sequence[Action]) -> None:
    """A list with REDUCE_GRAD reduces each stage that computes a backward exactly once, after its last one:
    a stage without would keep unreduced gradients, one reduced early would lose the later microbatches'."""
    last = _last_weight_actions(actions)
    reduces: dict[int, list[int]] = {}
    for i, a in enumerate(actions):
        if a.kind is ActionKind.REDUCE_GRAD:
            reduces.setdefault(a.stage, []).append(i)
    wrong = sorted(
        s
        for s in last.keys() | reduces.keys()
        if s not in last or len(reduces.get(s, [])) != 1 or reduces[s][0] < last[s]
    )
    if wrong:
        raise ValueError(
            f"REDUCE_GRAD must come once per stage, after the stage's last B or W (lower_schedule(reduce_grad=True) "
            f"places it so); stages {wrong} break that"
        )


def _set_gradient_sync(module: torch.nn.Module, sync_grads: bool, *, last: bool) -> None:
    """A data-parallel stage (FSDP, DDP) reduces its gradients in the step's last weight backward only, and
    FSDP keeps its parameters unsharded until then: one all-gather and one reduce-scatter per group and
    step, whatever the number of microbatches (torch's pipelining stage does the same)."""
    sync = getattr(module, "set_requires_gradient_sync", None)
    if sync is not None:
        sync(sync_grads and last)
    reshard = getattr(module, "set_reshard_after_backward", None)
    if reshard is not None:
        reshard(last)


def _finish_weight_backward(module: torch.nn.Module, sync_grads: bool) -> None:
    """After a stage's last W: reduce what its Ws accumulated (outside autograd's hooks) and reshard."""
    _set_gradient_sync(module, sync_grads, last=True)
    finish = getattr(module, "finish_backward", None)
    if finish is not None:
        finish()


def _params(stage: PipelineStage) -> list[torch.Tensor]:
    return [p for p in stage.module.parameters() if p.requires_grad]


def _release(live: dict, s: int, m: int) -> None:
    """Drop stage s's microbatch m once nothing needs it any more."""
    acts = live.get((s, m))
    if acts is not None and acts.weights_done and acts.grad_gone:
        del live[s, m]
