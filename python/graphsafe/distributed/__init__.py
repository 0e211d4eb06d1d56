"""graphsafe on torch.distributed: the pieces an optimizer step needs on sharded (DTensor / FSDP2) and
data-parallel (DDP) models. The core stays single-device; these helpers hand it a parameter's local shard and
combine per-shard values across ranks in a fixed order (DESIGN.md, "Many GPUs through torch.distributed").

  * local_view(t) -> (local tensor, ShardSpec | None): what the core reads and writes for a DTensor or plain tensor.
  * like_param(local_state, param): a local state wrapped as a DTensor of the parameter's layout (for
    optimizer.state_dict() and DCP), the state itself for a plain parameter.
  * sum_across_shards(partials, param): per-shard partial sums totalled over the shards, the same bits on every
    rank (LAMB/LARS norms); sum_rows_in_order is its order, for references.

graphsafe.optim's steps on DTensor parameters are built on these (python/graphsafe/optim/_shards.py).
"""

from .shard_sums import sum_across_shards, sum_rows_in_order
from .shard_views import ShardSpec, is_dtensor, like_param, local_view

__all__ = ["ShardSpec", "is_dtensor", "like_param", "local_view", "sum_across_shards", "sum_rows_in_order"]
