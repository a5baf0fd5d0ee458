"""Parallel styles: how one module is sharded over a 1-D tensor-parallel mesh, and how its inputs
and outputs are converted and redistributed. Names and defaults mirror torch's tensor parallel API.

    ColwiseParallel   Linear weight S(0) (+ bias S(0)), Embedding weight S(1); input R, output S(-1)
    RowwiseParallel   Linear weight S(1) (bias R),     Embedding weight S(0); input S(-1), output R
                      (the row-wise matmul gives P(sum); the output redistribute is the all_reduce,
                      or a reduce_scatter when the output layout is a Shard: sequence parallel;
                      the Embedding becomes a VocabParallelEmbedding, whose weight gradient is S(0))
    SequenceParallel  parameters replicated; activations sharded on the sequence dim
    PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: only convert layouts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..dtensor import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from ..dtensor.errors import StyleArgumentError
from .apply_order import check_param_layout, join_path
from .vocab_parallel import make_vocab_parallel


class ParallelStyle:
    """A recipe that shards one module; `parallelize_module` calls `apply(module, mesh)`."""

    src_data_rank: int | None = 0

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError

    def param_placements(self, module: nn.Module) -> dict[str, Placement] | None:
        """The TP placement this style gives each of `module`'s own parameters; None if it leaves
        parameters alone. parallelize_module checks existing DTensor parameters against it."""
        return None

    _apply = apply  # torch's private name, for code ported from torch


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None) -> Any:
    """Plain tensor -> DTensor with `layout` (already laid out so), then redistribute to `desired`."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):  # a DTensor input already carries its layout
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if desired is not None and x.placements != (desired,):
        x = x.redistribute(placements=(desired,), async_op=True)  # waited on first use, as torch
    return x


def _finish_output(x: Any, mesh: DeviceMesh, layout: Placement | None, use_local_output: bool) -> Any:
    if not isinstance(x, DTensor):
        return x
    if layout is not None and x.placements != (layout,):
        x = x.redistribute(placements=(layout,), async_op=True)  # waited on first use, as torch
    return x.to_local() if use_local_output else x


@dataclass(kw_only=True)
class ColwiseParallel(ParallelStyle):
    """Shard a Linear's output features (weight S(0)) or an Embedding's embedding dim (weight S(1)).

    Defaults: input_layouts Replicate(), output_layouts Shard(-1).
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        weight_dim = 1 if isinstance(module, nn.Embedding) else 0
        # the bias follows the output features
        return {key: Shard(weight_dim) for key, _ in module.named_parameters(recurse=False)}

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _shard_module(
            self,
            module,
            device_mesh,
            input_layout=self.input_layouts or Replicate(),
            desired_input=Replicate(),
            output_layout=self.output_layouts or Shard(-1),
        )


@dataclass(kw_only=True)
class RowwiseParallel(ParallelStyle):
    """Shard a Linear's input features (weight S(1), bias R) or an Embedding's vocabulary (weight S(0)).

    Defaults: input_layouts Shard(-1), output_layouts Replicate().
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        embedding = isinstance(module, nn.Embedding)
        # Linear weight (out, in) shards `in`; the bias is added once, after the reduce
        return {
            key: Shard(0) if embedding else Shard(1) if key == "weight" else Replicate()
            for key, _ in module.named_parameters(recurse=False)
        }

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        embedding = isinstance(module, nn.Embedding)
        if embedding:  # its weight gradient then comes out S(0) like the weight (vocab_parallel.py)
            make_vocab_parallel(module)  # type: ignore[arg-type]
        return _shard_module(
            self,
            module,
            device_mesh,
            input_layout=self.input_layouts or Shard(-1),
            desired_input=Replicate() if embedding else Shard(-1),
            output_layout=self.output_layouts or Replicate(),
        )


def _shard_module(
    style: ColwiseParallel | RowwiseParallel,
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    input_layout: Placement,
    desired_input: Placement,
    output_layout: Placement,
) -> nn.Module:
    """Shard a Linear/Embedding's parameters by `style.param_placements` and hook its input and output."""
    _check_module(style, module)

    def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        placements = style.param_placements(mod)
        for key, param in list(mod.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # already laid out so (a re-tied weight): keep it, and the tie
                check_param_layout(join_path(name, key), param, mesh, [placements[key]])
                continue
            sharded = distribute_tensor(param.data, mesh, [placements[key]], src_data_rank=style.src_data_rank)
            mod.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        mesh,
        partition,
        lambda mod, inputs, mesh: tuple(_to_dtensor(x, mesh, input_layout, desired_input) for x in inputs),
        lambda mod, out, mesh: _finish_output(out, mesh, output_layout, style.use_local_output),
    )


def _check_module(style: ParallelStyle, module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise NotImplementedError(
            f"{type(style).__name__} supports nn.Linear and nn.Embedding, got {type(module).__name__}; "
            f"apply it to the Linear/Embedding submodules instead"
        )


class SequenceParallel(ParallelStyle):
    """Replicate a module's parameters (norms) and run it on activations sharded on `sequence_dim`."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_layout = Shard(sequence_dim)
        self.use_local_output = use_local_output

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {key: Replicate() for key, _ in module.named_parameters(recurse=False)}

    def _replicate(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # already replicated on this mesh (tied), else an error
                check_param_layout(join_path(name, key), param, mesh, [Replicate()])
                continue
            # every rank holds identical parameters here (same init), so no broadcast is needed
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = inputs
        if isinstance(x, DTensor):
            if x.placements != (self.sequence_layout,):
                x = x.redistribute(placements=(self.sequence_layout,))
        elif isinstance(x, torch.Tensor):  # already this rank's sequence shard
            x = DTensor.from_local(x, mesh, (self.sequence_layout,), run_check=False)
        else:
            raise ValueError(
                f"SequenceParallel expects a tensor input for {type(module).__name__}, got {type(x).__name__}"
            )
        return (x, *rest)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate,
            self._prepare_input,
            lambda mod, out, mesh: out.to_local() if self.use_local_output and isinstance(out, DTensor) else out,
        )

    def __repr__(self) -> str:
        return f"SequenceParallel(sequence_dim={self.sequence_layout.dim}, use_local_output={self.use_local_output})"


def _as_tuple(layouts: Placement | Sequence[Placement | None] | None) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    return (layouts,) if isinstance(layouts, Placement) else tuple(layouts)


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional and keyword) to DTensors and redistribute them."""

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if self.input_layouts is not None and len(self.input_layouts) != len(self.desired_input_layouts or ()):
            raise StyleArgumentError(
                f"input_layouts and desired_input_layouts should have same length! got {self.input_layouts} and "
                f"{self.desired_input_layouts} (None marks inputs to leave alone)"
            )
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        self.use_local_output = use_local_output

    def _prepare(self, module: nn.Module, args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
        if self.input_layouts is not None:
            if len(args) != len(self.input_layouts):
                raise ValueError(
                    f"module inputs and input_layouts should have same length! module {type(module).__name__} got "
                    f"{len(args)} positional inputs, input_layouts has {len(self.input_layouts)}; give one layout "
                    f"per input (None leaves an input alone)"
                )
            # __init__ checked that desired_input_layouts has input_layouts' length
            layouts = zip(self.input_layouts, self.desired_input_layouts)  # type: ignore[arg-type]
            converted = tuple(self._convert(x, mesh, layout, desired) for x, (layout, desired) in zip(args, layouts))
            args = converted + tuple(args[len(self.input_layouts) :])
        for key, layout in self.input_kwarg_layouts.items():
            if key in kwargs:
                kwargs[key] = self._convert(
                    kwargs[key], mesh, layout, self.desired_input_kwarg_layouts.get(key, layout)
                )
        return args, kwargs

    def _convert(self, x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None) -> Any:
        x = _to_dtensor(x, mesh, layout, desired)
        return x.to_local() if self.use_local_output and isinstance(x, DTensor) else x

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._prepare(mod, args, kwargs, device_mesh), with_kwargs=True
        )
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleInput(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts})"
        )


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors with `output_layouts` and redistribute them."""

    def __init__(
        self,
        *,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = _as_tuple(output_layouts) or ()
        self.desired_output_layouts = _as_tuple(desired_output_layouts) or ()
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise StyleArgumentError(
                f"output_layouts and desired_output_layouts should have same length! got {self.output_layouts} "
                f"and {self.desired_output_layouts}"
            )
        self.use_local_output = use_local_output

    def _prepare(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        single = not isinstance(outputs, (tuple, list))
        items = (outputs,) if single else tuple(outputs)
        if len(items) != len(self.output_layouts):
            raise ValueError(
                f"module returned {len(items)} outputs, the plan's output_layouts has {len(self.output_layouts)}"
            )
        converted = []
        for x, layout, desired in zip(items, self.output_layouts, self.desired_output_layouts):
            x = _to_dtensor(x, mesh, layout, desired)
            converted.append(x.to_local() if self.use_local_output and isinstance(x, DTensor) else x)
        return converted[0] if single else type(outputs)(converted)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, inputs, outputs: self._prepare(mod, outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts})"
        )


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module."""

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_input.apply(module, device_mesh)
        return self.prepare_output.apply(module, device_mesh)
