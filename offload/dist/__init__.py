"""ZeRO partitioning over torch.distributed: each rank holds and offloads only its 1/N share of the model state.

* :mod:`._group` finds the ranks (an initialized torch.distributed, torchrun's environment, or one process) and
  owns the group's lifetime;
* :mod:`._comm` runs the collectives, counts their bytes, and turns a dead or hung peer into an error naming it;
* :mod:`._zero` moves gradients to their owners (reduce-scatter) and updated parameters back (all-gather).

The engine uses them on every run: with world size 1 the collectives are copies or nothing.
"""

from ._comm import Comm, CommError, CommState
from ._group import Origin, ProcessGroup, join
from ._zero import GradPartition, ParamShards

__all__ = ["Comm", "CommError", "CommState", "GradPartition", "Origin", "ParamShards", "ProcessGroup", "join"]
