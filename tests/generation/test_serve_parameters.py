"""Issue 28, acceptance 3: every field of the parameter table (docs/serving.md, from
``ortbatch.serve.served.parameters.FIELDS``) through the official ``openai`` client, on
``client.completions.create`` and ``client.chat.completions.create``, streamed and whole.

A honoured field must do what it says: its answer equals what the in-process generator gives
for the same :class:`SamplingParams` (the generator itself is held to transformers in
test_sampling_parity.py and test_serve_sampling.py), or shows the shape OpenAI / vLLM define;
an accepted field changes nothing; a refused field is a 400 naming it, and its neutral values are
taken. The table and this file cannot drift: a field without a case fails
:func:`test_every_field_has_a_case`. The structured-output and tool-calling fields have their own
file (test_serve_structured.py, which keeps its cases equal to the table the same way).
"""

from __future__ import annotations

import inspect
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation import SamplingParams
from ortbatch.generation.chat import ChatTemplate

from .conftest import EOS, TinyModel

pytest.importorskip("starlette")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")

from ortbatch.serve import BackgroundServer, ServedGenerator  # noqa: E402
from ortbatch.serve.served.parameters import ACCEPTED, CHAT, COMPLETIONS, FIELDS, REFUSED, STRUCTURED  # noqa: E402

NAME = "tiny"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "hi"}]
NEW = 6
LONG = 40
# renders tool calls, documents and a variable of chat_template_kwargs
TEMPLATE = (
    "{% if documents %}{% for d in documents %}[{{ d.title }}]{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}({{ c.function.name }}){% endfor %}.{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if greeting %}{{ greeting }}{% endif %}"
)


@pytest.fixture(scope="module")
def export(tiny_gpt2: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("params") / "export"
    shutil.copytree(tiny_gpt2.export, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def served(export: Path) -> Iterator[tuple[BackgroundServer, BatchedGenerator]]:
    gen = BatchedGenerator(export, max_batch_size=8)
    with BackgroundServer(ServedGenerator(gen, NAME)) as srv:
        yield srv, gen


@dataclass
class Result:
    """One answer, whole or gathered from its stream, per choice index."""

    id: str
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    stop_reasons: dict[int, Any] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    prompt_token_ids: Any = None
    logprobs: dict[int, Any] = field(default_factory=dict)
    prompt_logprobs: Any = None
    usage: Any = None
    chunk_usages: list[Any] = field(default_factory=list)
    chunks_with_choices: int = 0


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}


def _gather(chunks: list[Any], chat: bool) -> Result:
    out = Result(chunks[0].id)
    texts: dict[int, str] = defaultdict(str)
    parts: dict[int, list[Any]] = defaultdict(list)
    for c in chunks:
        d = c.model_dump()
        if d.get("usage"):
            out.usage = d["usage"]
            if d["choices"]:
                out.chunk_usages.append(d["usage"])
        if d.get("prompt_token_ids") is not None:
            out.prompt_token_ids = d["prompt_token_ids"]
        out.chunks_with_choices += bool(d["choices"])
        for ch in d["choices"]:
            i = ch["index"]
            texts[i] += (ch["delta"].get("content") or "") if chat else ch["text"]
            if ch.get("finish_reason"):
                out.finish[i], out.stop_reasons[i] = ch["finish_reason"], ch.get("stop_reason")
            if ch.get("token_ids") is not None:
                out.token_ids.setdefault(i, []).extend(ch["token_ids"])
            if ch.get("prompt_token_ids") is not None:
                out.prompt_token_ids = ch["prompt_token_ids"]
            if ch.get("logprobs"):
                parts[i].append(ch["logprobs"])
    out.texts = dict(texts)
    for i, p in parts.items():
        out.logprobs[i] = [x for q in p for x in q["content"]] if chat else _merge_completion_logprobs(p)
    return out


def _whole(answer: Any, chat: bool) -> Result:
    d = answer.model_dump()
    out = Result(d["id"], usage=d["usage"], prompt_logprobs=d.get("prompt_logprobs"))
    out.prompt_token_ids = d.get("prompt_token_ids")
    for ch in d["choices"]:
        i = ch["index"]
        out.texts[i] = ch["message"]["content"] if chat else ch["text"]
        out.finish[i], out.stop_reasons[i] = ch["finish_reason"], ch.get("stop_reason")
        if ch.get("token_ids") is not None:
            out.token_ids[i] = ch["token_ids"]
        if ch.get("prompt_token_ids") is not None:
            out.prompt_token_ids = ch["prompt_token_ids"]
        if ch.get("prompt_logprobs") is not None:
            out.prompt_logprobs = ch["prompt_logprobs"]
        if ch.get("logprobs"):
            out.logprobs[i] = ch["logprobs"]["content"] if chat else ch["logprobs"]
    return out


class Ask:
    """One request through the openai client: the fields it knows as its own keyword
    arguments, vLLM's through ``extra_body``."""

    def __init__(self, srv: BackgroundServer, gen: BatchedGenerator, api: str, stream: bool) -> None:
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.gen, self.api, self.stream, self.chat = gen, api, stream, api == CHAT
        create = self.client.chat.completions.create if self.chat else self.client.completions.create
        self._create = create
        self._own = set(inspect.signature(create).parameters)

    def __call__(self, **fields: Any) -> Result:
        body: dict[str, Any] = {"model": NAME, "temperature": 0}
        body["messages" if self.chat else "prompt"] = MESSAGES if self.chat else PROMPT
        body["max_completion_tokens" if self.chat and "max_tokens" not in fields else "max_tokens"] = NEW
        body.update(fields)
        kwargs = {k: v for k, v in body.items() if k in self._own}
        extra = {k: v for k, v in body.items() if k not in self._own}
        if self.stream:
            chunks = list(self._create(**kwargs, stream=True, extra_body=extra))
            return _gather(chunks, self.chat)
        return _whole(self._create(**kwargs, extra_body=extra), self.chat)

    def prompt_ids(self, messages: list[dict[str, Any]] | None = None, **render: Any) -> list[int]:
        if not self.chat:
            return self.gen.encode(PROMPT)
        text = ChatTemplate(TEMPLATE).render(messages or MESSAGES, **render)
        return self.gen.encode(text, add_special_tokens=False)

    def direct(self, ids: list[int] | None = None, **params: Any) -> list[Any]:
        """What the generator gives the same prompt in process (greedy, NEW tokens, unless said)."""
        params = {"max_new_tokens": NEW, **params}
        return self.gen.generate_choices(self.prompt_ids() if ids is None else ids, params=SamplingParams(**params))


Check = Callable[[Ask, Result], None]


def same_as(**params: Any) -> Check:
    """The answer's texts and token ids equal the in-process generator's for ``params``."""

    def check(ask: Ask, r: Result) -> None:
        want = ask.direct(**params)
        assert [r.texts[i] for i in range(len(want))] == [c.text for c in want]
        if r.token_ids:
            assert [r.token_ids[i] for i in range(len(want))] == [list(c.token_ids) for c in want]

    return check


def plain(ask: Ask, r: Result) -> None:
    """An accepted field: the answer is the plain greedy one."""
    same_as()(ask, r)


def both(*checks: Check) -> Check:
    def check(ask: Ask, r: Result) -> None:
        for c in checks:
            c(ask, r)

    return check


def _changed(**params: Any) -> Check:
    """same_as, and the parameter made a difference (else the comparison proves nothing)."""

    def check(ask: Ask, r: Result) -> None:
        same_as(**params)(ask, r)
        new = params.get("max_new_tokens", NEW)
        assert r.token_ids[0] != list(ask.direct(max_new_tokens=new)[0].token_ids)

    return check


def _stop_string(ask: Ask, r: Result) -> None:
    text = ask.direct()[0].text
    # two characters of the plain answer past its start (not U+FFFD: that is held back as a partial character)
    stop = next(text[i : i + k] for k in (2, 1) for i in range(1, len(text) - k + 1) if "\ufffd" not in text[i : i + k])
    r2 = ask(stop=stop, return_token_ids=True)
    assert r2.finish[0] == "stop" and r2.stop_reasons[0] == stop and stop not in r2.texts[0]
    same_as(stop=stop)(ask, r2)
    r3 = ask(stop=stop, include_stop_str_in_output=True)
    assert r3.texts[0].endswith(stop)
    same_as(stop=stop, include_stop_str_in_output=True)(ask, r3)


def _stop_token(ask: Ask, r: Result) -> None:
    ids = list(ask.direct()[0].token_ids)
    stop_id = next(t for i, t in enumerate(ids) if i >= 1 and t not in ids[:i])
    r2 = ask(stop_token_ids=[stop_id], return_token_ids=True)
    assert r2.finish[0] == "stop" and r2.stop_reasons[0] == stop_id and r2.token_ids[0][-1] == stop_id
    same_as(stop_token_ids=[stop_id])(ask, r2)


def _n(ask: Ask, r: Result) -> None:
    assert sorted(r.texts) == [0, 1, 2]
    same_as(n=3, temperature=1.0, seed=5)(ask, r)


def _best_of(ask: Ask, r: Result) -> None:
    runs = ask.direct(n=3, temperature=1.0, seed=5, logprobs=0)
    best = max(runs, key=lambda c: sum(lp.logprob for lp in c.logprobs))
    assert list(r.texts) == [0] and r.texts[0] == best.text and not r.logprobs


def _completion_logprobs(ask: Ask, r: Result) -> None:
    (want,) = ask.direct(logprobs=2)
    lp = r.logprobs[0]
    assert lp["tokens"] == [ask.gen.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)
    for top, x in zip(lp["top_logprobs"], want.logprobs, strict=True):
        names = [ask.gen.decode([t], skip_special_tokens=False) for t, _ in x.top]
        assert set(names) <= set(top) and len(top) <= 3
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def _chat_logprobs(ask: Ask, r: Result) -> None:
    (want,) = ask.direct(logprobs=2)
    content = r.logprobs[0]
    assert [c["logprob"] for c in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    joined = b"".join(bytes(c["bytes"]) for c in content)
    assert joined.decode("utf-8", errors="replace") == want.text or joined == want.text.encode()


def _echo(ask: Ask, r: Result) -> None:
    (want,) = ask.direct()
    if not ask.chat:
        assert r.texts[0] == PROMPT + want.text
        return
    # vLLM's chat echo: the last message, when it is the reply's role (an assistant turn here)
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    r2 = ask(messages=messages, echo=True)
    (continued,) = ask.direct(ask.prompt_ids(messages))
    assert r2.texts[0] == "Sure" + continued.text
    assert r.texts[0] == want.text  # the last turn is the user's: nothing echoed


def _echo_logprobs(ask: Ask, r: Result) -> None:
    """Completions: echo + logprobs + max_tokens 0, lm-evaluation-harness's loglikelihood request."""
    ids = ask.gen.encode(PROMPT)
    (want,) = ask.gen.generate_choices(ids, params=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    lp = r.logprobs[0]
    assert r.texts[0] == PROMPT and lp["tokens"] == [ask.gen.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]], abs=1e-6)


def _prompt_logprobs(ask: Ask, r: Result) -> None:
    (want,) = ask.direct(prompt_logprobs=1)
    got = r.prompt_logprobs
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for entry, x in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        own = entry[str(x.token_id)]
        assert own["logprob"] == pytest.approx(x.logprob, abs=1e-6) and own["rank"] == x.rank
        top_id = str(x.top[0][0])
        assert entry[top_id]["rank"] == 1


def _usage(ask: Ask, r: Result) -> None:
    assert r.usage["completion_tokens"] == NEW and r.usage["prompt_tokens"] == len(ask.prompt_ids())
    # continuous_usage_stats: every chunk, with the tokens so far
    assert len(r.chunk_usages) == r.chunks_with_choices and r.chunk_usages[-1]["completion_tokens"] == NEW


def _max_tokens(ask: Ask, r: Result) -> None:
    assert r.finish[0] == "length" and (ask.stream or r.usage["completion_tokens"] == 3)
    same_as(max_new_tokens=3)(ask, r)


def _truncate(side: str) -> Check:
    def check(ask: Ask, r: Result) -> None:
        ids = ask.prompt_ids()
        cut = ids[-3:] if side == "left" else ids[:3]
        assert r.prompt_token_ids == cut
        assert r.texts[0] == ask.direct(cut)[0].text

    return check


def _add_special_tokens(value: bool) -> Check:
    def check(ask: Ask, r: Result) -> None:
        text = PROMPT if not ask.chat else ChatTemplate(TEMPLATE).render(MESSAGES)
        assert r.prompt_token_ids == ask.gen.encode(text, add_special_tokens=value)

    return check


def _request_id(ask: Ask, r: Result) -> None:
    assert r.id == ("chatcmpl-" if ask.chat else "cmpl-") + "req-28"


def _token_ids_names(ask: Ask, r: Result) -> None:
    (want,) = ask.direct()
    names = [c["token"] for c in r.logprobs[0]] if ask.chat else r.logprobs[0]["tokens"]
    assert names == [f"token_id:{t}" for t in want.token_ids]


def _return_token_ids(ask: Ask, r: Result) -> None:
    assert r.token_ids[0] == list(ask.direct()[0].token_ids) and r.prompt_token_ids == ask.prompt_ids()


def _skip_special(ask: Ask, r: Result) -> None:
    assert r.texts[0] == "<s>" * NEW
    shown = ask(logit_bias={"1": 100}, ignore_eos=True)
    assert shown.texts[0] == ""


def _rendered(**render: Any) -> Check:
    """Chat: the prompt is the template rendered as transformers' apply_chat_template renders it."""

    def check(ask: Ask, r: Result) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ask.gen.export_dir)
        tok.chat_template = TEMPLATE
        options = dict(render)
        messages = options.pop("messages", MESSAGES)
        want = tok.apply_chat_template(messages, tokenize=False, **options)
        assert r.prompt_token_ids == ask.gen.encode(want, add_special_tokens=False)

    return check


TOOL_TURN = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    },
]


@dataclass
class Case:
    """A honoured or accepted field's request fields and what its answer must show."""

    fields: dict[str, Any]
    check: Check
    apis: tuple[str, ...] = (COMPLETIONS, CHAT)
    #: asked with a stream: the 400 it is (a field a stream cannot carry), else None
    streamed: str | None = None
    #: asked without a stream: the 400 it is (a stream's own field), else None
    whole: str | None = None


IDS = {"return_token_ids": True}
CASES: dict[str, Case | list[Case]] = {
    "model": Case({"model": NAME}, plain),
    "prompt": Case({"prompt": [PROMPT, PROMPT[:4]]}, lambda a, r: (len(r.texts) == 2) or pytest.fail(), (COMPLETIONS,)),
    "messages": [
        Case({"messages": MESSAGES, **IDS}, both(plain, _rendered(add_generation_prompt=True)), (CHAT,)),
        Case({"messages": TOOL_TURN, **IDS}, _rendered(messages=TOOL_TURN, add_generation_prompt=True), (CHAT,)),
    ],
    "max_tokens": Case({"max_tokens": 3}, _max_tokens),
    "max_completion_tokens": Case({"max_completion_tokens": 3, "max_tokens": 9}, _max_tokens, (CHAT,)),
    "temperature": Case({"temperature": 0.7, "seed": 3, **IDS}, same_as(temperature=0.7, seed=3)),
    "top_p": Case({"temperature": 1.0, "top_p": 0.3, "seed": 3, **IDS}, same_as(temperature=1.0, top_p=0.3, seed=3)),
    "top_k": Case({"temperature": 1.0, "top_k": 2, "seed": 3, **IDS}, same_as(temperature=1.0, top_k=2, seed=3)),
    "min_p": Case({"temperature": 1.0, "min_p": 0.5, "seed": 3, **IDS}, same_as(temperature=1.0, min_p=0.5, seed=3)),
    "seed": Case({"temperature": 1.0, "seed": 11, **IDS}, same_as(temperature=1.0, seed=11)),
    "n": Case({"n": 3, "temperature": 1.0, "seed": 5, **IDS}, _n),
    "best_of": Case({"best_of": 3, "temperature": 1.0, "seed": 5}, _best_of, (COMPLETIONS,), "'best_of' above 'n'"),
    "stop": Case({}, _stop_string),
    "include_stop_str_in_output": Case({}, _stop_string),
    "stop_token_ids": Case({}, _stop_token),
    # long enough for tokens to repeat, which is what the penalties act on
    "presence_penalty": Case(
        {"presence_penalty": 2.0, "max_tokens": LONG, **IDS}, _changed(presence_penalty=2.0, max_new_tokens=LONG)
    ),
    "frequency_penalty": Case(
        {"frequency_penalty": 2.0, "max_tokens": LONG, **IDS}, _changed(frequency_penalty=2.0, max_new_tokens=LONG)
    ),
    "repetition_penalty": Case(
        {"repetition_penalty": 3.0, "max_tokens": LONG, **IDS}, _changed(repetition_penalty=3.0, max_new_tokens=LONG)
    ),
    "logit_bias": Case(
        {"logit_bias": {"7": 100}, **IDS},
        both(_changed(logit_bias={7: 100}), lambda a, r: r.token_ids[0] == [7] * NEW or pytest.fail()),
    ),
    "min_tokens": Case(
        {"min_tokens": 3, "logit_bias": {str(EOS): 100}, **IDS},
        both(
            same_as(min_tokens=3, logit_bias={EOS: 100}),
            lambda a, r: r.token_ids[0] == [*r.token_ids[0][:3], EOS] or pytest.fail(),
        ),
    ),
    "ignore_eos": Case(
        {"ignore_eos": True, "logit_bias": {str(EOS): 100}, **IDS},
        both(
            same_as(ignore_eos=True, logit_bias={EOS: 100}), lambda a, r: r.token_ids[0] == [EOS] * NEW or pytest.fail()
        ),
    ),
    "skip_special_tokens": Case(
        {"skip_special_tokens": False, "ignore_eos": True, "logit_bias": {"1": 100}}, _skip_special
    ),
    "logprobs": [
        Case({"logprobs": 2}, _completion_logprobs, (COMPLETIONS,)),
        Case({"logprobs": True, "top_logprobs": 2}, _chat_logprobs, (CHAT,)),
        Case({"logprobs": 0, "echo": True, "max_tokens": 0}, _echo_logprobs, (COMPLETIONS,)),
    ],
    "top_logprobs": Case({"logprobs": True, "top_logprobs": 2}, _chat_logprobs, (CHAT,)),
    "echo": Case({"echo": True}, _echo),
    "prompt_logprobs": Case({"prompt_logprobs": 1}, _prompt_logprobs, streamed="not available when 'stream'"),
    "stream": Case({}, plain),
    "stream_options": Case(
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        _usage,
        whole="only allowed when 'stream' is true",
    ),
    "truncate_prompt_tokens": Case({"truncate_prompt_tokens": 3, **IDS}, _truncate("left")),
    "truncation_side": Case({"truncate_prompt_tokens": 3, "truncation_side": "right", **IDS}, _truncate("right")),
    "add_special_tokens": [Case({"add_special_tokens": v, **IDS}, _add_special_tokens(v)) for v in (True, False)],
    "request_id": Case({"request_id": "req-28"}, _request_id),
    "return_tokens_as_token_ids": [
        Case({"return_tokens_as_token_ids": True, "logprobs": 1}, _token_ids_names, (COMPLETIONS,)),
        Case({"return_tokens_as_token_ids": True, "logprobs": True}, _token_ids_names, (CHAT,)),
    ],
    "return_token_ids": Case(IDS, _return_token_ids),
    "add_generation_prompt": Case(
        {"add_generation_prompt": False, **IDS}, _rendered(add_generation_prompt=False), (CHAT,)
    ),
    "continue_final_message": Case(
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Su"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            **IDS,
        },
        _rendered(messages=[*MESSAGES, {"role": "assistant", "content": "Su"}], continue_final_message=True),
        (CHAT,),
    ),
    "chat_template_kwargs": Case(
        {"chat_template_kwargs": {"greeting": "Yo"}, **IDS},
        _rendered(add_generation_prompt=True, greeting="Yo"),
        (CHAT,),
    ),
    "documents": Case(
        {"documents": [{"title": "T", "text": "x"}], **IDS},
        _rendered(add_generation_prompt=True, documents=[{"title": "T", "text": "x"}]),
        (CHAT,),
    ),
}
# accepted fields (no effect): a value each
ACCEPTED_VALUES: dict[str, Any] = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "safety_identifier": "s",
    "spaces_between_special_tokens": False,
    "session_id": "s",
    "cache_salt": "salt",
    "return_token_offsets": True,
    "return_mm_kwargs": False,
}
# refused fields: a value that asks for what is not there
REFUSED_VALUES: dict[str, Any] = {
    "suffix": "x",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "service_tier": "flex",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "typical_p": 0.9,
    "watermarking": True,
    "allowed_token_ids": [5],
    "bad_words": ["x"],
    "logprob_token_ids": [5],
    "prompt_embeds": "AAAA",
    "priority": 1,
    "routed_experts_prompt_start": 1,
    "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "repetition_detection": {"n": 2},
    "thinking_token_budget": 5,
    "stream_interval": 2,
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1},
    "include_reasoning": False,
    "return_prompt_text": True,
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
}


def test_every_field_has_a_case() -> None:
    honoured = {n for n, f in FIELDS.items() if f.handling not in (ACCEPTED, REFUSED, STRUCTURED)}
    assert set(CASES) == honoured
    assert set(ACCEPTED_VALUES) == {n for n, f in FIELDS.items() if f.handling == ACCEPTED}
    assert set(REFUSED_VALUES) == {n for n, f in FIELDS.items() if f.handling == REFUSED}


def _cases() -> list[Any]:
    out = []
    for name, cases in CASES.items():
        for k, case in enumerate(cases if isinstance(cases, list) else [cases]):
            for api in case.apis:
                assert api in FIELDS[name].apis, (name, api)
                for stream in (False, True):
                    out.append(
                        pytest.param(name, case, api, stream, id=f"{name}{k}-{api}-{'stream' if stream else 'whole'}")
                    )
    return out


@pytest.mark.parametrize(("name", "case", "api", "stream"), _cases())
def test_honoured_fields_do_what_they_say(served: Any, name: str, case: Case, api: str, stream: bool) -> None:
    srv, gen = served
    ask = Ask(srv, gen, api, stream)
    refusal = case.streamed if stream else case.whole
    if refusal is not None:
        with pytest.raises(openai.BadRequestError, match=refusal):
            ask(**case.fields)
        return
    case.check(ask, ask(**case.fields))


@pytest.mark.parametrize("name", sorted(ACCEPTED_VALUES))
@pytest.mark.parametrize("stream", [False, True])
def test_accepted_fields_change_nothing(served: Any, name: str, stream: bool) -> None:
    srv, gen = served
    for api in sorted(FIELDS[name].apis):
        ask = Ask(srv, gen, api, stream)
        plain(ask, ask(**{name: ACCEPTED_VALUES[name]}, return_token_ids=True))


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
@pytest.mark.parametrize("stream", [False, True])
def test_refused_fields_are_400s_naming_them(served: Any, name: str, stream: bool) -> None:
    srv, gen = served
    f = FIELDS[name]
    for api in sorted(f.apis):
        ask = Ask(srv, gen, api, stream)
        with pytest.raises(openai.BadRequestError) as err:
            ask(**{name: REFUSED_VALUES[name]})
        assert err.value.body["param"] == name and f"'{name}' is not supported" in err.value.body["message"]
        for neutral in (None, *f.neutral):  # values that ask for nothing are taken
            plain(ask, ask(**{name: neutral}, return_token_ids=True))


@pytest.mark.parametrize("api", [COMPLETIONS, CHAT])
def test_a_field_no_api_defines_is_refused_as_openai_refuses_it(served: Any, api: str) -> None:
    srv, gen = served
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: grammar"):
        Ask(srv, gen, api, False)(grammar="root ::= x")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": [[3, 1.0]]}, "logit_bias"),  # OpenAI's logit_bias is a map, not pairs
        ({"user": 5}, "user"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        (
            {"stream_options": {"include_usage": False, "continuous_usage_stats": 1}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
@pytest.mark.parametrize("api", [COMPLETIONS, CHAT])
def test_a_value_of_the_wrong_shape_is_a_400_naming_the_field(
    served: Any, api: str, fields: dict[str, Any], param: str
) -> None:
    srv, gen = served
    with pytest.raises(openai.BadRequestError) as err:
        Ask(srv, gen, api, "stream_options" in fields)(**fields)
    assert err.value.body["param"] == param and f"'{param}' must be" in err.value.body["message"]


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"]])
def test_a_prompt_of_no_accepted_shape_names_prompt(served: Any, prompt: Any) -> None:
    srv, gen = served
    with pytest.raises(openai.BadRequestError) as err:
        Ask(srv, gen, COMPLETIONS, False)(prompt=prompt)
    assert err.value.body["param"] == "prompt" and "'prompt' must be a string" in err.value.body["message"]
