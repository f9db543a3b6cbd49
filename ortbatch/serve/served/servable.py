"""What every served thing shares: :class:`~.model.ServedModel`,
:class:`~.generator.ServedGenerator` and :class:`~.repository.ModelRepository` alike, as
the runners and transports use them (ready checks, the shutdown drain)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Servable"]


@runtime_checkable
class Servable(Protocol):
    """A thing a server serves: named, ready or not, closed once (draining its requests
    by default)."""

    name: str

    @property
    def ready(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def close(self, drain: bool = True) -> None: ...
