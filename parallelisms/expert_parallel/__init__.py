"""Expert parallelism on meshtrain's DTensor: routed experts sharded over an ep mesh, tokens moved to them by
all-to-all (dispatch.py), applied as a parallel style (style.py)."""

from .dispatch import all_to_all_rows_autograd, combine, dispatch
from .style import ExpertParallel

__all__ = ["ExpertParallel", "all_to_all_rows_autograd", "combine", "dispatch"]
