"""Bridges to the loops people already train with; each imports its framework lazily (an optional extra).

``offload.integrations.transformers``: :class:`OffloadTrainer`, transformers' Trainer on the offload engine.
"""

__all__: list[str] = []
