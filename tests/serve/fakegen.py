"""A duck-typed BatchedGenerator for server tests that need no decoder export: every
character of a text prompt is one token, and each request generates ``max_tokens``
tokens ``"ab"[i % 2]``. With ``hold=True`` each request emits its first token and then
waits until it is cancelled (a stream whose client is expected to leave)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any


class FakeGenerator:
    def __init__(self, *, hold: bool = False, max_queue: int = 64, context: int = 4096) -> None:
        self.hold = hold
        self.max_queue = max_queue
        self.layout = SimpleNamespace(max_context_length=context)
        self.export_dir = None
        self.closed = False
        self.submitted: list[Any] = []
        self.cancelled = threading.Semaphore(0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode("utf-8")  # as the real tokenizer: a lone surrogate fails here
        return [ord(c) % 50 for c in text]

    def submit(self, prompt: Any, max_new_tokens: int, *, on_token: Any = None, **sampling: Any) -> Future[Any]:
        from ortbatch.errors import InvalidInputError

        if not len(prompt):  # as the real one: "" and [] are refused by submit
            raise InvalidInputError("prompt is empty", input_name="prompt")
        if isinstance(prompt, str):
            raise AssertionError(f"the server tokenizes text prompts itself, got {prompt!r}")
        if any(not 0 <= t < 50 for t in prompt):
            raise InvalidInputError("a token id is outside the vocabulary", input_name="prompt")
        if len(prompt) + max_new_tokens > self.layout.max_context_length:
            raise InvalidInputError("prompt + max_new_tokens exceeds the context", input_name="prompt")
        fut: Future[Any] = Future()
        self.submitted.append((list(prompt), max_new_tokens, sampling))
        threading.Thread(target=self._run, args=(fut, len(prompt), max_new_tokens, on_token), daemon=True).start()
        return fut

    def submit_choices(
        self, prompt: Any, max_new_tokens: int | None = None, *, params: Any = None, on_token: Any = None, **kw: Any
    ) -> list[Future[Any]]:
        """What the serve layer calls: ``params`` (a SamplingParams) says how; its ``n``
        choices each generate alike."""
        if params is not None:
            max_new_tokens = params.max_new_tokens if params.max_new_tokens is not None else 16
            kw = {"temperature": params.temperature, **kw}
        futures = []
        for choice in range(params.n if params is not None else 1):
            tagged = (
                None if on_token is None else (lambda tok, c=choice: on_token(SimpleNamespace(**vars(tok), choice=c)))
            )
            futures.append(self.submit(prompt, max_new_tokens, on_token=tagged, **kw))
        return futures

    def generate(self, prompt: Any, max_new_tokens: int, **sampling: Any) -> Any:
        """The blocking call (what a repository's warm-up runs)."""
        return self.submit(prompt, max_new_tokens, **sampling).result()

    def _run(self, fut: Future[Any], n_prompt: int, n: int, on_token: Any) -> None:
        text = ""
        for i in range(n):
            piece = "ab"[i % 2]
            text += piece
            if on_token is not None:
                on_token(SimpleNamespace(text=piece, token_id=i, index=i, logprob=None, prompt_logprobs=None))
            if self.hold:
                while not fut.cancelled():
                    threading.Event().wait(0.01)
                self.cancelled.release()
                return
        if fut.set_running_or_notify_cancel():
            fut.set_result(
                SimpleNamespace(
                    text=text,
                    finish_reason="length",
                    prompt_tokens=n_prompt,
                    completion_tokens=n,
                    token_ids=tuple(range(n)),
                    stop_sequence=None,
                    logprobs=None,
                    prompt_logprobs=None,
                )
            )

    def stats(self) -> Any:
        counters = ("queued", "active_rows", "completed", "failed", "cancelled", "timed_out", "rejected")
        totals = ("prompt_tokens", "generated_tokens", "decode_steps")
        return SimpleNamespace(
            **dict.fromkeys(counters + totals, 0),
            submitted=len(self.submitted),
            cache_padding_fraction=0.0,
            mean_decode_rows=0.0,
        )

    def close(self, drain: bool = True) -> None:
        self.closed = True
