"""What crosses between the engine and a front-end process.

* **Arenas** (:class:`Arena`): anonymous shared memory (``memfd_create``), one per front
  end per direction, mapped by both processes. Tensor bytes live there; a message only
  says where (offset, size). Each arena has exactly one allocating side: the front end
  allocates in its request arena (and frees a block when the engine's answer to it
  arrives); the engine allocates in the response arena (and frees a block when the front
  end says it has copied it out). Nothing is named in ``/dev/shm``, so a process that
  dies leaks nothing: the memory goes when the last mapping does.
* **Frames** (:func:`write_frame` / :class:`FrameReader`): over a Unix socket, a frame
  is ``[u32 header bytes][u64 payload bytes][pickled list of messages][payload]``.
  Messages are small tuples of ints, strings and shapes (never tensors); one frame
  carries every message ready at that moment. A tensor that does not fit its arena
  travels in the payload instead, as raw bytes.
* **Errors** (:func:`encode_error` / :func:`decode_error`): an exception raised in the
  engine crosses as its class's module and name, its message and its simple attributes,
  and is rebuilt as the same class on the other side (a QueueFullError stays a
  QueueFullError with its ``queued``/``max_queue``), so status codes are the ones the
  one-process server gives.
"""

from __future__ import annotations

import importlib
import mmap
import os
import pickle
import socket
import struct
import threading
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InferenceError, InvalidInputError, OrtBatchError

__all__ = [
    "ALIGN",
    "Arena",
    "ArenaHandle",
    "BlockAllocator",
    "FrameReader",
    "TensorSpec",
    "decode_error",
    "encode_error",
    "pack_tensors",
    "unpack_tensors",
    "write_frame",
]

#: every block starts on a 64-byte boundary (cache line; any dtype's alignment)
ALIGN = 64
_HEAD = struct.Struct("<IQ")
#: one tensor in a message: (name, dtype str, shape, where, offset, nbytes); where 0 = the
#: arena (offset from its start), 1 = the frame's payload (offset from the payload's start)
TensorSpec = tuple[str, str, tuple[int, ...], int, int, int]
IN_ARENA, IN_PAYLOAD = 0, 1


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class BlockAllocator:
    """First-fit allocation of aligned blocks in ``[0, size)``, coalescing on free.

    Thread-safe. ``alloc`` returns an offset, or None when no free run is large enough
    (the caller falls back to the frame's payload); a block of 0 bytes still gets a
    distinct offset of one alignment unit so that it can be freed like any other."""

    def __init__(self, size: int) -> None:
        self.size = size // ALIGN * ALIGN
        self._lock = threading.Lock()
        # free runs, sorted by offset: parallel lists of starts and sizes
        self._starts: list[int] = [0] if self.size else []
        self._sizes: dict[int, int] = {0: self.size} if self.size else {}
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def blocks(self) -> int:
        """Blocks allocated and not yet freed."""
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        need = _aligned(max(nbytes, 1))
        with self._lock:
            for i, start in enumerate(self._starts):
                run = self._sizes[start]
                if run >= need:
                    del self._sizes[start]
                    if run == need:
                        del self._starts[i]
                    else:
                        self._starts[i] = start + need
                        self._sizes[start + need] = run - need
                    self._used[start] = need
                    return start
        return None

    def free(self, offset: int) -> None:
        """Return a block; freeing an offset that is not allocated is a ValueError (a
        bookkeeping bug must not silently corrupt the arena)."""
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"offset {offset} is not an allocated block")
            i = bisect_left(self._starts, offset)
            # merge with the following run
            if i < len(self._starts) and self._starts[i] == offset + size:
                nxt = self._starts.pop(i)
                size += self._sizes.pop(nxt)
            # merge with the preceding run
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._sizes[prev] == offset:
                    self._sizes[prev] += size
                    return
            insort(self._starts, offset)
            self._sizes[offset] = size


class ArenaHandle:
    """An arena's file descriptor as a ``multiprocessing`` argument: pickled for a spawned
    child, the descriptor itself is handed over (``DupFd``), not the memory's contents."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_rebuild_handle, (DupFd(self.fd), self.size))


def _rebuild_handle(dup: Any, size: int) -> ArenaHandle:
    return ArenaHandle(dup.detach(), size)


class Arena:
    """A shared-memory region of ``size`` bytes mapped into this process."""

    def __init__(self, handle: ArenaHandle) -> None:
        self.handle = handle
        self.size = handle.size
        self._mm = mmap.mmap(handle.fd, handle.size)
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)

    @classmethod
    def create(cls, size: int, name: str = "ortbatch-arena") -> Arena:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(ArenaHandle(fd, size))
        except BaseException:
            os.close(fd)
            raise

    def write(self, offset: int, array: np.ndarray) -> None:
        n = array.nbytes
        if n:
            self.buffer[offset : offset + n] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def view(self, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> np.ndarray:
        """A zero-copy array over the arena's bytes (valid while the block is held)."""
        return self.buffer[offset : offset + nbytes].view(np.dtype(dtype)).reshape(shape)

    def close(self) -> None:
        """Close the descriptor; the mapping goes when the last array over it does."""
        try:
            os.close(self.handle.fd)
        except OSError:
            pass


def _check_packable(name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype.hasobject:
        raise InvalidInputError(
            f"input {name!r}: string (BYTES) tensors cannot cross to the engine process; "
            "serve this model with --frontends 1",
            input_name=name,
        )
    # ascontiguousarray makes a 0-d array 1-d: a scalar would cross as shape [1]
    return np.ascontiguousarray(array).reshape(array.shape)


def pack_tensors(
    items: Iterable[tuple[str, np.ndarray]], arena: Arena, allocator: BlockAllocator, payload: bytearray
) -> tuple[list[TensorSpec], int | None]:
    """Lay ``items`` out in one block of ``arena`` (or, when it has no room, at the end
    of ``payload``); returns their specs and the block's offset (None: in the payload)."""
    arrays = [(name, _check_packable(name, a)) for name, a in items]
    total = sum(_aligned(a.nbytes) for _, a in arrays)
    block = allocator.alloc(total)
    specs: list[TensorSpec] = []
    if block is not None:
        pos = block
        for name, a in arrays:
            arena.write(pos, a)
            specs.append((name, a.dtype.str, a.shape, IN_ARENA, pos, a.nbytes))
            pos += _aligned(a.nbytes)
        return specs, block
    for name, a in arrays:
        specs.append((name, a.dtype.str, a.shape, IN_PAYLOAD, len(payload), a.nbytes))
        payload += a.reshape(-1).view(np.uint8).data
    return specs, None


def unpack_tensors(
    specs: Sequence[TensorSpec], arena: Arena, payload: bytearray | memoryview, copy: bool
) -> list[tuple[str, np.ndarray]]:
    """The arrays ``specs`` describe: views of the arena (``copy=False``; valid while
    their block is held) or copies; payload tensors are views of ``payload``."""
    out = []
    pbuf = np.frombuffer(payload, dtype=np.uint8) if len(payload) else None
    for name, dtype, shape, where, offset, nbytes in specs:
        if where == IN_ARENA:
            a = arena.view(dtype, shape, offset, nbytes)
            out.append((name, a.copy() if copy else a))
        else:
            assert pbuf is not None
            out.append((name, pbuf[offset : offset + nbytes].view(np.dtype(dtype)).reshape(shape)))
    return out


def write_frame(sock: socket.socket, messages: Sequence[Any], payload: bytes | bytearray = b"") -> None:
    """Send one frame (all of ``messages`` and the payload bytes they refer to)."""
    head = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    if payload:
        sock.sendall(b"".join((_HEAD.pack(len(head), len(payload)), head)))
        sock.sendall(payload)
    else:
        sock.sendall(_HEAD.pack(len(head), 0) + head)


class FrameReader:
    """Blocking reader of frames from a socket (buffered: one ``recv`` usually brings
    several frames)."""

    def __init__(self, sock: socket.socket, buffer_size: int = 1 << 20) -> None:
        self._file: Any = sock.makefile("rb", buffering=buffer_size)

    def _exact(self, n: int) -> bytes | None:
        data = self._file.read(n)
        if len(data) < n:
            return None
        return data

    def read(self) -> tuple[list[Any], bytearray] | None:
        """The next frame's messages and payload; None at end of stream (the other
        process closed its end or died)."""
        try:
            head = self._exact(_HEAD.size)
            if head is None:
                return None
            hlen, plen = _HEAD.unpack(head)
            body = self._exact(hlen)
            if body is None:
                return None
            payload = bytearray(plen)
            if plen and self._file.readinto(payload) < plen:  # BufferedReader fills it or hits EOF
                return None
        except (OSError, ValueError):  # reset, or the file closed under us on shutdown
            return None
        messages: list[Any] = pickle.loads(body)
        return messages, payload

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass


_SIMPLE = (str, int, float, bool, type(None))


def _simple(value: Any) -> bool:
    """A value that crosses as it is: a scalar, or a dict of them by string (headers)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and isinstance(v, _SIMPLE) for k, v in value.items())
    return isinstance(value, _SIMPLE)


def encode_error(exc: BaseException) -> tuple[str, str, str, dict[str, Any]]:
    """``(module, class name, message, simple attributes)`` of an exception (scalars, and
    dicts of them such as an HTTPError's headers)."""
    cls = type(exc)
    attrs = {k: v for k, v in vars(exc).items() if _simple(v)} if hasattr(exc, "__dict__") else {}
    message = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
    return cls.__module__, cls.__qualname__, message, attrs


def decode_error(module: str, name: str, message: str, attrs: Mapping[str, Any]) -> BaseException:
    """The exception :func:`encode_error` described, as the same class when it is one of
    ortbatch's errors or a builtin exception; anything else becomes an InferenceError
    naming it (never an arbitrary class built from a message)."""
    cls: Any = None
    if module == "builtins" or module == "ortbatch" or module.startswith("ortbatch."):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return InferenceError(f"{name}: {message}")
    if module == "builtins" and not issubclass(cls, OrtBatchError):
        return cls(message)
    exc: BaseException = cls.__new__(cls)
    Exception.__init__(exc, message)
    for k, v in attrs.items():
        setattr(exc, k, v)
    return exc
