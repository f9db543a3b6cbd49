"""The one model lookup: which entry of what is served answers a request naming a model
(and maybe a version). HTTP's KServe routes, gRPC's router and the repository's routes
all ask it, so an unknown model or version is the same
:class:`~ortbatch.errors.ModelNotFoundError`, with the same words, on every transport.

One :class:`~.model.ServedModel` answers as two entries when it has a tokenizer: its
tensor entry (``name``) and its text-in view (``{name}_text``, :class:`~.textview.TextModelView`).
A :class:`~.generator.ServedGenerator` answers as its one entry (version ``"1"``).
"""

from __future__ import annotations

from typing import Any

from ...errors import ModelNotFoundError
from .kinds import kind_of

__all__ = ["GENERATOR_VERSION", "Entries"]

#: the version a generation export's entry answers as (it has no other)
GENERATOR_VERSION = "1"


class Entries:
    """The entries of one served model, by name (the text view is made once)."""

    def __init__(self, served: Any) -> None:
        self.served = served
        self.kind = kind_of(served)
        #: the ``{name}_text`` entry beside it (a ServedModel's :class:`~.textview.TextModelView`)
        self.text_view: Any = self.kind.text_view(served)

    def find(self, name: str, version: str | None = None) -> Any:
        """The model (or text view, or generator) answering ``name`` at ``version``
        (None or ``""``: any); :class:`~ortbatch.errors.ModelNotFoundError` otherwise."""
        served = self.served
        if self.text_view is not None and name == self.text_view.name:
            found: Any = self.text_view
        elif name == served.name:
            found = served
        else:
            raise ModelNotFoundError(f"unknown model {name!r}; this server serves {served.name!r}")
        served_version = self.kind.version(served, found)
        if version and version != served_version:
            raise ModelNotFoundError(f"unknown version {version!r} of model {name!r}; served: {served_version!r}")
        return found
