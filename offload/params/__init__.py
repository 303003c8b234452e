"""Parameter offload (ZeRO-3 / ZeRO-Infinity for parameters): homes on HOST or NVMe, a bounded device window,
module hooks and trace-driven prefetch. See ``_offload.py``, which coordinates the parts beside it."""

from ._offload import ParameterOffload
from ._record import ParamState
from ._window import check_window

__all__ = ["ParamState", "ParameterOffload", "check_window"]
