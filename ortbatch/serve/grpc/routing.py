"""Which model a gRPC request reaches: the one model of ``ortbatch serve DIR``, or a model
of a :class:`~ortbatch.serve.served.repository.ModelRepository` (``ortbatch serve --repository
ROOT`` or several DIRs), by the request's model name and version.

Both routers answer the same questions for :class:`~.service.InferenceServicer`, with the
words the HTTP side uses for the same case: an unknown model is NOT_FOUND, a repository
model that is loading or unloaded UNAVAILABLE (HTTP's 503). A text-generation export is
answered as a decoupled model (:mod:`.generation`): streamed over ModelStreamInfer, its
unary ModelInfer UNIMPLEMENTED, naming the alternatives. A request
holds its repository model (:meth:`ModelRepository.acquire`) until it is answered, so an
unload or reload waits for it, as for an HTTP request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import ModelNotFoundError, OrtBatchError, UnsupportedError
from ..served.lookup import Entries
from ..served.repository import LOAD_PARAMETERS, UNLOAD_PARAMETERS, ModelRepository, check_parameters

__all__ = ["OneModel", "RepositoryModels", "Router", "router_for"]


def _answering(entries: Entries, name: str, version: str) -> Any:
    """What answers the RPCs for entry ``name``, as its model kind maps it
    (:meth:`~ortbatch.serve.served.kinds.ModelKind.grpc_model`): the model, its text-in view
    ``{name}_text``, or a generation export as a decoupled model."""
    return entries.kind.grpc_model(entries.find(name, version))


def _no_repository() -> UnsupportedError:
    return UnsupportedError(
        "this server serves one model: the repository RPCs need a model repository "
        "(ortbatch serve --repository ROOT, or several DIRs)"
    )


class Router:
    """What the servicer asks about the models it serves."""

    #: ServerMetadata's extensions
    extensions: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def model_ready(self, name: str, version: str) -> bool:
        """ModelReady: false (never an error) for a model that cannot answer now."""
        try:
            with self.hold(name, version) as found:
                return bool(found.ready)
        except OrtBatchError:
            return False

    def hold(self, name: str, version: str) -> Any:
        """A context manager giving the model (or text view) that answers ``name``."""
        raise NotImplementedError

    def index(self, ready_only: bool) -> list[dict[str, Any]]:
        raise _no_repository()

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        raise _no_repository()

    async def unload(self, name: str, parameters: dict[str, Any]) -> None:
        raise _no_repository()


class OneModel(Router):
    """The one model of ``ortbatch serve DIR`` and its ``{name}_text`` entry."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entries = Entries(model)

    @property
    def ready(self) -> bool:
        return self.model.ready

    @contextmanager
    def hold(self, name: str, version: str) -> Iterator[Any]:
        yield _answering(self.entries, name, version)


class RepositoryModels(Router):
    """Every model of a repository, by name; and its index, load and unload."""

    extensions = ("model_repository",)

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository

    @property
    def ready(self) -> bool:
        return self.repository.ready

    @contextmanager
    def hold(self, name: str, version: str) -> Iterator[Any]:
        repo = self.repository
        if not name:
            raise ModelNotFoundError("the request names no model")
        loaded = repo.acquire(repo.base_name(name))  # ModelNotFoundError / ModelUnavailableError
        try:
            yield _answering(Entries(loaded.served), name, version)
        finally:
            repo.release(loaded)

    def model_ready(self, name: str, version: str) -> bool:
        repo = self.repository
        try:
            loaded = repo.acquire(repo.base_name(name))
        except Exception:  # unknown, loading or unloaded
            return False
        try:
            Entries(loaded.served).find(name, version)
        except ModelNotFoundError:
            return False
        else:
            return bool(loaded.served.ready)  # a generation export is ready too: it serves HTTP
        finally:
            repo.release(loaded)

    def index(self, ready_only: bool) -> list[dict[str, Any]]:
        return self.repository.index(ready_only=ready_only)

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        check_parameters(parameters, LOAD_PARAMETERS)
        await self.repository.load(name)

    async def unload(self, name: str, parameters: dict[str, Any]) -> None:
        check_parameters(parameters, UNLOAD_PARAMETERS)
        await self.repository.unload(name)


def router_for(served: Any) -> Router:
    if isinstance(served, ModelRepository):
        return RepositoryModels(served)
    return OneModel(served)
