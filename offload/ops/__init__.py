"""Compute kernels used by the offloaded optimizer.

:func:`adam_step` is the single-pass CPU Adam/AdamW update over flat fp32 buffers (optionally also writing a bf16 or
fp16 copy of the new parameters); :func:`cpu_adam_backend` says which implementation it runs on this machine.
"""

from ._cpu_adam import adam_step, cpu_adam_backend, host_stream_buffer, supported_isas

__all__ = ["adam_step", "cpu_adam_backend", "host_stream_buffer", "supported_isas"]
