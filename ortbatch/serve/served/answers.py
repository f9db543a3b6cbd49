"""What a completion's answer carries, transport-free: each choice as :class:`Piece` objects
(one whole, or one per streamed token), and how OpenAI and vLLM shape them.

A :class:`Piece` is a choice's new text, the tokens it came with and their log-probabilities,
and on the last one the finish reason and the :class:`~ortbatch.generation.requests.Completion`.
:func:`whole_pieces` makes one per answered choice from finished completions (``best_of``
picks its ``n`` there); :class:`~ortbatch.serve.served.streaming.PieceStream` makes them as the
tokens come. :class:`OpenAIAnswer` turns them into the JSON of ``/v1/completions`` and
``/v1/chat/completions`` (vLLM's and the ``openai`` package's shapes); with chat's tools, each
choice's text is parsed into ``message.tool_calls`` (``finish_reason: "tool_calls"``), or, streamed,
fed to that choice's own :class:`~ortbatch.generation.tools.ToolStreamParser`, whose pieces become
``delta.tool_calls`` as OpenAI streams them. gRPC and KServe v2 ``generate`` use
:func:`completion_logprobs` for their ``logprobs`` output.

Logprobs are the generator's (the model's float32 logits before temperature, penalties and
bias); a token is named by its own text, decoded alone with special tokens kept (as vLLM
names it), or ``token_id:N`` (``return_tokens_as_token_ids``); ``bytes`` are its own bytes
(OpenAI's definition: a token may hold part of a UTF-8 character).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...generation.tools import ToolCallDelta, ToolStreamParser
from .completions import CompletionRequest, Prompts, usage

__all__ = [
    "OpenAIAnswer",
    "Piece",
    "TokenTexts",
    "completion_logprobs",
    "opening",
    "stop_reason",
    "whole_pieces",
]

#: OpenAI's and vLLM's floor for a logprob (-inf is not JSON)
_FLOOR = -9999.0

Entry = tuple[int, Any]  # (token id, its TokenLogprob, or None for a prompt's first token)


class TokenTexts:
    """Each token's text and bytes as logprobs name them (cached per id)."""

    def __init__(self, generator: Any) -> None:
        self._generator = generator
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._generator.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._generator.token_bytes([token_id])[0])
        return raw

    def name(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.text(token_id)


@dataclass
class Piece:
    """A piece of one choice's answer (``index``: its place among the answer's choices)."""

    index: int
    text: str = ""
    #: the logprobs shown with this piece (``None``: not asked)
    entries: list[Entry] | None = None
    token_ids: list[int] = field(default_factory=list)
    #: the choice's first piece: its prompt's ids (for ``return_token_ids``)
    prompt_ids: list[int] | None = None
    #: tokens the choice has generated so far (continuous usage)
    generated: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: the last piece: the finished Completion
    completion: Any = None
    #: the choice failed (a stream's piece only)
    error: BaseException | None = None

    @property
    def first(self) -> bool:
        return self.prompt_ids is not None


def stop_reason(completion: Any, params: Any) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the completion
    (``None`` for eos, length or anything else)."""
    if completion.finish_reason != "stop":
        return None
    if completion.stop_sequence is not None:
        return str(completion.stop_sequence)
    last = completion.token_ids[-1] if completion.token_ids else None
    return int(last) if last is not None and last in params.stop_token_ids else None


def opening(req: CompletionRequest, prompts: Prompts, index: int, prompt_logprobs: Any) -> Piece:
    """A choice's first piece before its first token: the echoed prompt (with its logprobs
    when asked) and, for ``return_token_ids``, the prompt's ids."""
    i = index // req.runs
    piece = Piece(index, prompts.echo[i], prompt_ids=prompts.ids[i])
    if req.logprobs is not None:
        piece.entries = []
        if req.echo and not req.chat and prompt_logprobs is not None:
            piece.entries = list(zip(prompts.ids[i], prompt_logprobs, strict=True))
    return piece


def _score(completion: Any) -> float:
    return float(sum(lp.logprob for lp in completion.logprobs or ()))


def whole_pieces(req: CompletionRequest, prompts: Prompts, results: Sequence[Any]) -> list[Piece]:
    """One piece per answered choice, from the finished completions (in ``submit_all``'s
    order). ``best_of``: each prompt's ``n`` with the highest sum of token logprobs, best first."""
    pieces: list[Piece] = []
    for i in range(len(prompts.ids)):
        runs = list(results[i * req.runs : (i + 1) * req.runs])
        if req.best_of:
            runs = sorted(runs, key=_score, reverse=True)[: req.n]
        for j, c in enumerate(runs):
            piece = opening(req, prompts, i * req.runs + j, c.prompt_logprobs)
            piece.index = i * req.n + j
            piece.text += c.text
            if piece.entries is not None:
                piece.entries.extend(zip(c.token_ids, c.logprobs or (), strict=False))
            piece.token_ids = list(c.token_ids)
            piece.generated = c.completion_tokens
            piece.finish_reason, piece.stop_reason, piece.completion = c.finish_reason, stop_reason(c, req.params), c
            pieces.append(piece)
    return pieces


def completion_logprobs(
    entries: Sequence[Entry], texts: TokenTexts, k: int, offset: int = 0, as_ids: bool = False
) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` of ``entries`` (``tokens``, ``token_logprobs``, ``top_logprobs``:
    the ``k`` most likely and the chosen token, so up to ``k + 1`` as OpenAI says, keyed by text;
    ``text_offset``
    from ``offset``, each token's text after the last), and the offset after them."""
    tokens: list[str] = []
    chosen: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in entries:
        name = texts.name(token_id, as_ids)
        tokens.append(name)
        offsets.append(offset)
        offset += len(texts.text(token_id))
        if lp is None:  # a prompt's first token: nothing precedes it
            chosen.append(None)
            tops.append(None)
            continue
        chosen.append(max(lp.logprob, _FLOOR))
        # tokens whose texts are the same (partial UTF-8 characters) share a key: the most
        # likely one's value stays, so the largest value is always the top token's
        top: dict[str, float] = {}
        for t, v in lp.top[:k]:
            top.setdefault(texts.name(t, as_ids), max(v, _FLOOR))
        top.setdefault(name, max(lp.logprob, _FLOOR))
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": chosen, "tokens": tokens, "top_logprobs": tops}, offset


def chat_logprobs(entries: Sequence[Entry], texts: TokenTexts, k: int, as_ids: bool = False) -> dict[str, Any]:
    """Chat's ``logprobs``: ``content``, one object per token with its ``bytes`` and ``top_logprobs``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.name(token_id, as_ids), "logprob": max(logprob, _FLOOR), "bytes": texts.bytes(token_id)}

    content = [{**one(t, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top[:k]]} for t, lp in entries]
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(completion: Any, texts: TokenTexts, k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (``None`` for the first) its own and the top
    ``k`` alternatives, by id: ``{"logprob", "rank", "decoded_token"}``."""
    out: list[dict[str, Any] | None] = []
    for lp in completion.prompt_logprobs or ():
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): _vllm_logprob(texts, lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(t), _vllm_logprob(texts, t, v, rank))
        out.append(entry)
    return out


def _vllm_logprob(texts: TokenTexts, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": max(logprob, _FLOOR), "rank": rank, "decoded_token": texts.text(token_id)}


class OpenAIAnswer:
    """The JSON of one answer of ``/v1/completions`` or ``/v1/chat/completions``."""

    def __init__(
        self,
        req: CompletionRequest,
        prompts: Prompts,
        texts: TokenTexts,
        model: str,
        *,
        ident: str | None = None,
        created: int | None = None,
    ) -> None:
        """``ident`` (after ``cmpl-`` or ``chatcmpl-``; default the request's ``request_id``,
        else random) and ``created`` (default now): given by ``ortbatch run``, whose answers
        must be the same bytes when a job is resumed."""
        self.req, self.prompts, self.texts = req, prompts, texts
        self.chat = req.chat
        self.object = "chat.completion" if req.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if req.chat else "text_completion"
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        ident = req.request_id or ident or secrets.token_hex(12)
        when = int(time.time()) if created is None else created
        self.head = {"id": prefix + ident, "created": when, "model": model}
        self._offsets: dict[int, int] = {}  # a stream's text_offset so far, per choice
        self._parsers: dict[int, ToolStreamParser] = {}  # a stream's tool calls so far, per choice

    def logprobs(self, piece: Piece) -> dict[str, Any] | None:
        """The ``logprobs`` of ``piece`` (``None`` when not asked); a stream's text offsets go on
        from the choice's last piece."""
        if piece.entries is None or self.req.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(piece.entries, self.texts, self.req.logprobs, self.req.tokens_as_ids)
        start = self._offsets.get(piece.index, 0)
        out, self._offsets[piece.index] = completion_logprobs(
            piece.entries, self.texts, self.req.logprobs, start, self.req.tokens_as_ids
        )
        return out

    def whole(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        """The whole answer of finished choices."""
        choices = []
        for p in pieces:
            reason = p.finish_reason
            if self.chat:
                message, reason = self._message(p)
                choice: dict[str, Any] = {"index": p.index, "message": message}
            else:
                choice = {"index": p.index, "text": p.text}
            choice.update(logprobs=self.logprobs(p), finish_reason=reason, stop_reason=p.stop_reason)
            if self.req.return_token_ids:
                choice["token_ids"] = p.token_ids
                if not self.chat:
                    choice["prompt_token_ids"] = p.prompt_ids
            if self.req.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(p.completion, self.texts, self.req.prompt_logprobs)
            choices.append(choice)
        doc: dict[str, Any] = {**self.head, "object": self.object, "choices": choices}
        doc["usage"] = usage(self.prompts, [p.completion for p in pieces])
        if self.chat and pieces:
            if self.req.prompt_logprobs is not None:
                doc["prompt_logprobs"] = vllm_prompt_logprobs(
                    pieces[0].completion, self.texts, self.req.prompt_logprobs
                )
            if self.req.return_token_ids:
                doc["prompt_token_ids"] = pieces[0].prompt_ids
        return doc

    def _message(self, piece: Piece) -> tuple[dict[str, Any], str | None]:
        """A whole chat choice's ``message`` and finish reason: with tools, the text parsed
        into content and ``tool_calls`` (``finish_reason`` ``"tool_calls"`` when there are)."""
        tools = self.req.tools
        if tools is None:
            return {"role": "assistant", "content": piece.text}, piece.finish_reason
        generated = piece.completion.text  # the echo, when asked, is content before it
        parsed = tools.parse(generated)
        content = piece.text[: len(piece.text) - len(generated)] + (parsed.content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        return message, None if piece.finish_reason is None else parsed.finish_reason(piece.finish_reason)

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat's first chunk of a choice: the role (as OpenAI's streams open)."""
        delta = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        if not self.req.continuous_usage:
            return self.chunk([delta])
        prompt = len(self.prompts.ids[index // self.req.runs])
        return self.chunk([delta], usage={"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt})

    def piece_chunk(self, piece: Piece) -> dict[str, Any] | None:
        """The stream chunk of one piece (``None``: it carries nothing to send, as when a tool
        call's text is held back until it is known to be one)."""
        reason = piece.finish_reason
        if self.chat and self.req.tools is not None:
            delta, reason = self._tool_delta(piece)
            if not delta and reason is None and piece.entries is None and not self.req.return_token_ids:
                return None
            choice: dict[str, Any] = {"index": piece.index, "delta": delta}
        elif self.chat:
            content = None if piece.finish_reason is not None and not piece.text else piece.text
            choice = {"index": piece.index, "delta": {} if content is None else {"content": content}}
        else:
            choice = {"index": piece.index, "text": piece.text}
        choice.update(logprobs=self.logprobs(piece), finish_reason=reason, stop_reason=piece.stop_reason)
        extra: dict[str, Any] = {}
        if self.req.return_token_ids:
            choice["token_ids"] = piece.token_ids
            if piece.first:
                (extra if self.chat else choice)["prompt_token_ids"] = piece.prompt_ids
        if self.req.continuous_usage:
            prompt = len(self.prompts.ids[piece.index // self.req.runs])
            extra["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": piece.generated,
                "total_tokens": prompt + piece.generated,
            }
        return self.chunk([choice], **extra)

    def _tool_delta(self, piece: Piece) -> tuple[dict[str, Any], str | None]:
        """A streamed chat piece's ``delta`` and finish reason with tools: the choice's text fed
        to its own :class:`~ortbatch.generation.tools.ToolStreamParser`; content as it becomes
        certain, ``tool_calls`` pieces as OpenAI streams them (id and name, then arguments)."""
        parser = self._parsers.get(piece.index)
        if parser is None:
            assert self.req.tools is not None
            parser = self._parsers[piece.index] = self.req.tools.stream_parser()
        text, echo = piece.text, ""
        if piece.first:  # the echo, when asked, is content before the generated text
            echo = self.prompts.echo[piece.index // self.req.runs]
            text = text[len(echo) :]
        deltas = [parser.feed(text) if text else None]
        if piece.finish_reason is not None:
            deltas.append(parser.finish())
        content = echo + "".join(d.content or "" for d in deltas if d is not None)
        calls = _joined([c for d in deltas if d is not None for c in d.tool_calls])
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [c.to_openai() for c in calls]
        reason = parser.finish_reason(piece.finish_reason) if piece.finish_reason is not None else None
        return delta, reason

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """One stream chunk carrying ``choices``."""
        return {**self.head, "object": self.chunk_object, "choices": choices, **extra}

    def usage_chunk(self, completions: Sequence[Any]) -> dict[str, Any]:
        return self.chunk([], usage=usage(self.prompts, completions))


def _joined(deltas: Sequence[ToolCallDelta]) -> list[ToolCallDelta]:
    """Tool-call deltas of one chunk with each call's consecutive argument pieces joined (a
    piece and the stream's end can both add to one call)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.id is None and d.name is None:
            out[-1] = ToolCallDelta(last.index, last.id, last.name, (last.arguments or "") + (d.arguments or ""))
        else:
            out.append(d)
    return out
