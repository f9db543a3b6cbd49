"""Turning a growing list of token ids into text, with stop strings. Pure Python.

Byte-level BPE tokenizers can split one character over several tokens, so the text of
a prefix may end in U+FFFD until the rest arrives, and a stop string may arrive in
pieces. :class:`TextTracker` therefore holds back what could still change and hands
out only text that is final.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextTracker"]

_REPLACEMENT = "\ufffd"


class TextTracker:
    """Decode the generated ids of one request incrementally.

    ``decode(ids) -> str`` is the tokenizer's decode with special tokens skipped (or
    ``None`` when the export has no tokenizer: text stays empty). ``push`` returns the
    newly final text and whether a stop string was completed. ``include_stop``: the text
    keeps the matched stop string (vLLM's ``include_stop_str_in_output``) instead of ending
    before it. ``push(id, check_stop=False)`` (a row still short of ``min_tokens``) looks for
    no stop string, and a later match must end in text that came after: vLLM's detokenizer
    checks only the new text of each token past ``min_tokens``.
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str] | None, stop: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        # Only a short window of ids is decoded per token (prefix..end, minus the text of
        # prefix..read), so a long completion costs O(n), not O(n^2), decoding; decoding
        # the window together with a few ids before it keeps word-boundary spaces right.
        self._prefix = 0
        self._read = 0
        self._text = ""
        self._emitted = 0
        # a stop string must end after this position of the text (see check_stop)
        self._floor = 0
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text decoded so far (cut before the stop string once one matched, or after it
        with ``include_stop``)."""
        return self._text

    def push(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Add one generated id; return (text that became final, stop string matched).
        ``check_stop=False``: no stop string may end in this id's text."""
        if self._decode is None or self.stop_string is not None:
            return "", self.stop_string is not None
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        # An unfinished multi-byte character decodes to U+FFFD: wait for the rest.
        if len(window) <= len(before) or window.endswith(_REPLACEMENT):
            return "", False
        self._text += window[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if not check_stop:
            self._floor = len(self._text)
        return self._advance()

    def _advance(self) -> tuple[str, bool]:
        text = self._text
        if self._stop:
            # Only the tail can contain a stop string that was not already there.
            start = max(0, self._emitted - self._holdback)
            hits = [(i, s) for s in self._stop if (i := text.find(s, max(start, self._floor - len(s) + 1))) != -1]
            if hits:
                index, self.stop_string = min(hits)
                self._text = text[: index + len(self.stop_string) if self._include_stop else index]
                return self._flush(), True
        end = len(text) - self._holdback
        if end <= self._emitted:
            return "", False
        delta = text[self._emitted : end]
        self._emitted = end
        return delta, False

    def finish(self, check_stop: bool = True) -> str:
        """The text not yet handed out; call once when the request ends (``check_stop`` as
        the last :meth:`push` had it).

        Ids still held back (an unfinished character) are decoded as they are, as the
        tokenizer's own ``decode`` of the whole completion would show them."""
        if self._decode is not None and self.stop_string is None and self._read < len(self._ids):
            before = self._decode(self._ids[self._prefix : self._read])
            window = self._decode(self._ids[self._prefix :])
            self._text += window[len(before) :]
            self._read = len(self._ids)
            if not check_stop:
                self._floor = len(self._text)
            delta, _ = self._advance()  # a stop string may complete in the tail
            if self.stop_string is not None:
                return delta
            return delta + self._flush()
        return self._flush()

    def _flush(self) -> str:
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta
