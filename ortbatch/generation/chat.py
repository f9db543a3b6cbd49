"""Chat templates: turn a list of chat messages into the prompt text a chat model expects.

Hugging Face tokenizers carry a Jinja template (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja`` beside it) that transformers renders
in ``apply_chat_template``. :class:`ChatTemplate` renders it the same way without
transformers: a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` filter, ``raise_exception`` and
``strftime_now``, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables. The rendered text already holds the special tokens, so it is tokenized without
adding any (``BatchedGenerator.encode(text, add_special_tokens=False)``), as transformers
does. Needs ``jinja2`` (in the ``serve`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .._extras import require
from ..errors import InvalidInputError
from .layout import token_text

__all__ = ["ChatTemplate"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
#: longest string (or list) a template's ``*`` may build, and the largest ``**`` exponent:
#: the template comes from the export, so what it can allocate is bounded
MAX_TEMPLATE_VALUE = 1_000_000
_MAX_EXPONENT = 64


class ChatTemplate:
    """A chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        jinja2 = require("jinja2", "serve")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InvalidInputError(f"the chat template refused the messages: {message}", input_name="messages")

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            """The sandbox, with ``*`` and ``**`` unable to build huge values."""

            intercepted_binops = frozenset({"*", "**"})

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
                    raise InvalidInputError(
                        f"the chat template raised a number to the power {right}", input_name="messages"
                    )
                if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                    left, right = right, left
                sized = isinstance(left, (str, list, tuple)) and isinstance(right, int)
                if operator == "*" and sized and len(left) * right > MAX_TEMPLATE_VALUE:
                    raise InvalidInputError(
                        f"the chat template built a value over {MAX_TEMPLATE_VALUE} long", input_name="messages"
                    )
                return super().call_binop(context, operator, left, right)

        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        #: whether the template loops over a message's content: it reads OpenAI's content parts
        #: (vLLM's "openai" content format), so a chat's text parts reach it as a list
        self.reads_content_parts = _loops_over_content(env.parse(source))

    @classmethod
    def from_export(cls, directory: str | Path) -> ChatTemplate | None:
        """The export's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, the ``default`` one when several are named), or ``None``."""
        d = Path(directory)
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        source: Any = None
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
                source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            return None
        specials = {k: text for k in _SPECIAL if (text := token_text(config.get(k))) is not None}
        return cls(source, specials)

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads the ``tools`` variable (so it can show the model tools)."""
        return "tools" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``);
        raises :class:`InvalidInputError` when the template rejects them.

        ``tools`` (JSON schemas of functions, ``[{"type": "function", "function": {...}}]``)
        and ``documents`` are the template's variables of those names, ``None`` when not
        given, as transformers' ``apply_chat_template(tools=..., documents=...)`` passes them;
        :func:`ortbatch.generation.tools.template_messages` turns OpenAI messages (tool calls,
        ``role: "tool"`` results) into what templates read. ``extra`` are more template
        variables (they win over the special tokens, as in transformers).
        ``continue_final_message``: the text ends where the last message's content does, left
        open for the model to continue, as transformers' ``apply_chat_template`` cuts it (not
        with ``add_generation_prompt``)."""
        jinja2 = require("jinja2", "serve")
        chat = [dict(m) for m in messages]
        final = ""
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidInputError(
                    "continue_final_message and add_generation_prompt are exclusive", input_name="messages"
                )
            content = chat[-1].get("content") if chat else None
            texts = (
                [i for i, p in enumerate(content) if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
                if isinstance(content, list)
                else []
            )
            if isinstance(content, str):
                final = content
                chat[-1]["content"] = final + _CONTINUE_TAG
            elif texts:  # content parts: the last text part is continued, as transformers continues it
                parts = [dict(p) if isinstance(p, Mapping) else p for p in content or ()]
                final = parts[texts[-1]]["text"]
                parts[texts[-1]]["text"] = final + _CONTINUE_TAG
                chat[-1]["content"] = parts
            else:
                raise InvalidInputError(
                    "continue_final_message needs a last message with text content", input_name="messages"
                )
        variables = {
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None if documents is None else [dict(d) for d in documents],
            **self.special_tokens,
            **extra,
        }
        try:
            text = str(self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables))
        except InvalidInputError:
            raise
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            AssertionError,  # jinja's own filters assert their arguments (truncate(-1))
            ArithmeticError,
            RecursionError,
        ) as exc:
            message = f"the chat template failed on these messages: {exc}"
            raise InvalidInputError(message, input_name="messages") from exc
        return _cut_at_final_message(text, final) if continue_final_message else text


def _loops_over_content(ast: Any) -> bool:
    """Whether a parsed template has a ``{% for ... in x['content'] %}`` loop (through filters:
    ``x.content | selectattr(...)``), as vLLM detects a template that reads content parts."""
    from jinja2 import nodes

    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
    return False


# transformers' marker of where the final message ends (utils/chat_template_utils.py)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_final_message(text: str, final: str) -> str:
    """The rendered ``text`` cut where the final message (marked by the tag) ends, as transformers cuts it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InvalidInputError(
            "continue_final_message: the final message does not appear in the chat the template rendered",
            input_name="messages",
        )
    at = text.rindex(tag)
    # the template kept the tag's trailing space: the message is whole; else it trimmed spacing
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
