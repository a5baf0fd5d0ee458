"""Which modules each pipeline stage holds: torchtitan's split of a decoder's layers, torch-free (the pre-flight
checks a split without importing torch)."""

from __future__ import annotations


def module_fqns_per_stage(
    num_stages: int, n_layers: int, *, first_stage_less_layers: int = 1, last_stage_less_layers: int = 1
) -> list[list[str]]:
    """The module names of each stage (parallelism.pipeline_parallel_first/last_stage_less_layers)."""
    if num_stages == 1:
        return [["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]]
    effective = n_layers + first_stage_less_layers + last_stage_less_layers
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or max(first_stage_less_layers, last_stage_less_layers) > per_stage:
        raise ValueError(
            f"{num_stages} pipeline stages over {n_layers} layers + {first_stage_less_layers} (embedding) + "
            f"{last_stage_less_layers} (norm, output) = {effective} effective layers is {per_stage} per stage: "
            f"every stage needs a layer and the embedding / output weights may not outweigh one stage; lower "
            f"parallelism.pipeline_parallel_degree or the *_stage_less_layers, or set module_fqns_per_model_part"
        )
    parts, layer = [], 0
    for stage in range(num_stages):
        budget = per_stage + (1 if stage < extra else 0)
        names = ["tok_embeddings"] if stage == 0 else []
        budget -= first_stage_less_layers if stage == 0 else 0
        budget -= last_stage_less_layers if stage == num_stages - 1 else 0
        take = min(max(budget, 0), n_layers - layer)
        names += [f"layers.{i}" for i in range(layer, layer + take)]
        layer += take
        parts.append(names + (["norm", "output"] if stage == num_stages - 1 else []))
    if layer != n_layers:
        raise ValueError(f"the split placed {layer} of {n_layers} layers; set module_fqns_per_model_part")
    return parts


def check_module_fqns(parts: list[list[str]], n_layers: int) -> None:
    """An explicit split (parallelism.module_fqns_per_model_part) must cut the model's modules, in their
    forward order, into non-empty consecutive parts: stage s runs its modules and hands the result to stage
    s + 1, so a module left out, named twice or out of order would train another model without a word."""
    order = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    named = [name for part in parts for name in part]
    empty = [s for s, part in enumerate(parts) if not part]
    problem = ""
    if empty:
        problem = f"parts {empty} are empty"
    elif unknown := sorted(set(named) - set(order)):
        problem = f"{unknown} are not modules of the model"
    elif repeated := sorted({name for name in named if named.count(name) > 1}):
        problem = f"{repeated} are named more than once"
    elif missing := [name for name in order if name not in named]:
        problem = f"{missing} are in no part"
    elif named != order:
        problem = f"the parts name the modules in the order {named}"
    if problem:
        raise ValueError(
            f"parallelism.module_fqns_per_model_part: {problem}; give every module once, in forward order, cut "
            f"into consecutive non-empty parts: {', '.join(order[:3])}, ..., {', '.join(order[-2:])} "
            f"(e.g. 'tok_embeddings,layers.0;layers.1,norm,output')"
        )
