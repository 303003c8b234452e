"""ZeRO partitioning over torch.distributed: each rank holds and offloads only its 1/N share of the model state.

* :mod:`._group` finds the ranks (an initialized torch.distributed, torchrun's environment, or one process) and
  owns the group's lifetime;
* :mod:`._comm` runs the collectives, counts their bytes, and turns a dead or hung peer into an error naming it;
* :mod:`._sync` makes every rank start from rank 0's parameters and buffers, copying only those that differ;
* :mod:`._buckets` sums gradients onto their owners in buckets while backward runs (stages 1-2);
* :mod:`._zero` reduce-scatters stage 3's gradients, gathers updated parameters back, and sizes a rank's NVMe
  pieces (the pieces themselves are where a parameter lives: :mod:`offload.params._shards`).

The engine uses them on every run: with world size 1 the collectives are copies or nothing.
"""

from ._buckets import BucketState, ReduceBuckets
from ._comm import Comm, CommError, CommState, OutOfStep
from ._group import Origin, ProcessGroup, join
from ._sync import StartSync, agree_on_settings, agree_with_rank0
from ._zero import GradPartition

__all__ = ["BucketState", "Comm", "CommError", "CommState", "GradPartition", "Origin", "OutOfStep", "ProcessGroup",
           "ReduceBuckets", "StartSync", "agree_on_settings", "agree_with_rank0", "join"]
