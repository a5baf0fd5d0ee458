"""FSDP2-style fully sharded data parallelism on meshtrain's DTensor (mirrors torch's fully_shard).

policy.py   MixedPrecisionPolicy
param.py    FSDPParam: one parameter's sharded DTensor and its freeable unsharded leaf
group.py    ParamGroup: one flat all-gather / one flat reduce-scatter per fully_shard module
state.py    FSDPState: forward/backward hooks, root detection, end-of-backward callback
api.py      fully_shard, FSDPModule
"""

from .api import FSDPModule, fully_shard
from .policy import MixedPrecisionPolicy

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
