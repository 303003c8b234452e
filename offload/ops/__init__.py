"""Compute kernels used by the offloaded optimizer.

:func:`adam_step` is the single-pass CPU Adam/AdamW update over flat fp32 buffers (optionally also writing a bf16 or
fp16 copy of the new parameters, and returning the squares of the gradient it read); :func:`squared_norm` is those
squares alone, for a norm needed before the update; :func:`cpu_adam_backend` says which implementation runs here.
"""

from ._cpu_adam import adam_step, cpu_adam_backend, host_stream_buffer, squared_norm, supported_isas

__all__ = ["adam_step", "cpu_adam_backend", "host_stream_buffer", "squared_norm", "supported_isas"]
