"""The batching runtime: BatchedSession and the parts it is made of.

``session`` (public face) · ``scheduler`` (queue + batch formation, pure Python) ·
``collate`` (pad/stack, split/trim; pure numpy) · ``executor`` (IOBinding, providers) ·
``signature`` (what is known about the model's axes) · ``stats``.
"""

from .collate import Collator, PaddingCollator, Prepared
from .session import BatchedSession
from .stats import Stats

__all__ = ["BatchedSession", "Collator", "PaddingCollator", "Prepared", "Stats"]
