"""``ortbatch serve DIR --frontends N``: N front-end processes over one engine process.

The front ends accept connections (HTTP and gRPC), parse, check and tokenize, and hand
tensors (or a generation's token ids) to the engine, which owns the export's one
BatchedSession or BatchedGenerator, or a repository's (so batching is global); the tensor
bytes go through shared memory, the control messages over a Unix socket, and errors come
back as the same classes (the same status codes as one process).

* :mod:`.transport`: arenas, the allocator, frames, errors across the boundary.
* :mod:`.proxy`: :class:`ProxySession`, the front end's link, and the sessions its
  ServedModels wrap.
* :mod:`.generation`: :class:`ProxyGenerator`, the generator a front end's
  ServedGenerator wraps.
* :mod:`.models`: several models (a repository) over front ends.
* :mod:`.frontend`: a front-end process's main.
* :mod:`.engine`: :func:`serve_frontends`, the engine and its supervision.
"""

from __future__ import annotations

from .engine import serve_frontends

__all__ = ["serve_frontends"]
