"""FSDP2-style fully sharded data parallelism on meshtrain's DTensor (mirrors torch's fully_shard).

policy.py       MixedPrecisionPolicy
param.py        FSDPParam: one parameter's sharded DTensor and its freeable unsharded leaf (or cast all-gather)
collectives.py  FlatBuffers: the flat buffer layout (copy-in, all-gather, copy-out, reduce-scatter, HSDP)
group.py        ParamGroup: the sharded state (SHARDED / SHARDED_POST_FORWARD / UNSHARDED) of one group
state.py        FSDPState: the training state machine (IDLE / FORWARD / PRE_BACKWARD / POST_BACKWARD), hooks
api.py          fully_shard, FSDPModule
"""

from .fsdp_module import FSDPModule, fully_shard, precompute_all_gather_scales
from .policy import MixedPrecisionPolicy

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard", "precompute_all_gather_scales"]
