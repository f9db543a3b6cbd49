"""Chat templates rendered without transformers, as transformers renders them, and
/v1/chat/completions over real HTTP with the official openai client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import InvalidInputError
from ortbatch.generation import SamplingParams
from ortbatch.generation.chat import ChatTemplate

from .conftest import TinyModel, assert_openai_answer

pytest.importorskip("jinja2")

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{% if loop.index0 == 0 and message['role'] == 'system' %}"
    "{{ '[SYS] ' + message['content'] | trim + ' [/SYS]' }}{% continue %}{% endif %}"
    "{{ '<' + message['role'] + '>\\n\\n' + message['content'] | trim + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n\\n' }}{% endif %}"
)
STRICT = (
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "Héllo wörld, 漢字?"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again"},
]


@pytest.mark.parametrize("source", [CHATML, LLAMA3_LIKE], ids=["chatml", "llama3-like"])
def test_renders_and_tokenizes_as_transformers(tiny_gpt2: TinyModel, source: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2.source)
    tok.chat_template = source
    want_text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want_ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    template = ChatTemplate(source, {"bos_token": tok.bos_token, "eos_token": tok.eos_token})
    text = template.render(MESSAGES)
    assert text == want_text
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=1) as gen:
        assert gen.encode(text, add_special_tokens=False) == list(want_ids)


@pytest.mark.parametrize("source", [CHATML, LLAMA3_LIKE], ids=["chatml", "llama3-like (trims content)"])
def test_continue_final_message_as_transformers(tiny_gpt2: TinyModel, source: str) -> None:
    """The last message left open, cut as transformers cuts it (a template that trims the content
    loses the trailing spaces there too); tools and documents are None unless given, as there."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2.source)
    tok.chat_template = source
    messages = [*MESSAGES[1:3], {"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Once upon  "}]
    want = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    template = ChatTemplate(source, {"bos_token": tok.bos_token, "eos_token": tok.eos_token})
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == want
    assert template.render(messages, add_generation_prompt=False) == tok.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidInputError, match="exclusive"):
        template.render(messages, continue_final_message=True)


def test_template_errors_are_bad_input() -> None:
    template = ChatTemplate(STRICT)
    assert template.render(MESSAGES[1:2]) == 'user: "Héllo wörld, 漢字?"\nassistant:'
    with pytest.raises(InvalidInputError, match="roles must be user or assistant"):
        template.render(MESSAGES)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    # a filter's own assertion on what the messages made of its argument is bad input too, not a 500
    cut = ChatTemplate("{% for m in messages %}{{ m['content'] | truncate(m['content'] | length - 9) }}{% endfor %}")
    with pytest.raises(InvalidInputError, match="failed on these messages"):
        cut.render([{"role": "user", "content": "short"}])


def test_template_comes_from_the_export(tmp_path: Path) -> None:
    assert ChatTemplate.from_export(tmp_path) is None
    config = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}
    config["eos_token"] = {"content": "</s>", "lstrip": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_export(tmp_path)
    assert template is not None and template.source == CHATML and template.special_tokens == {"eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text(STRICT)  # the file wins, as in transformers
    template = ChatTemplate.from_export(tmp_path)
    assert template is not None and template.source == STRICT


def _served_prompt(source: str, messages: list[dict]) -> str:
    from ortbatch.serve.served.completions import parse_chat_request, render_bounded

    template = ChatTemplate(source)
    chat, _ = parse_chat_request({"messages": messages}, template)
    return render_bounded(template, chat, 2.0, 10**6)


def test_text_parts_are_joined_with_newlines_as_vllm_joins_them() -> None:
    """vLLM gives a template that reads text the parts joined with "\n"; the reference is
    transformers' rendering of that one string."""
    from transformers.utils.chat_template_utils import render_jinja_template

    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "two parts"}]
    joined = [{"role": "user", "content": "Look:\ntwo parts"}]
    (want,), _ = render_jinja_template(conversations=[joined], chat_template=CHATML, add_generation_prompt=True)
    assert _served_prompt(CHATML, [{"role": "user", "content": parts}]) == want


# a template that reads content parts (as Llama 3.2 Vision's, Gemma 3's, Mistral Small 3.1's do)
PARTS = (
    "{% for message in messages %}{{ '<' + message['role'] + '>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}[{{ part['text'] }}]{% endfor %}"
    "{% endif %}{{ '</' + message['role'] + '>' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("continued", [False, True], ids=["generation-prompt", "continue-final-message"])
def test_a_template_that_reads_content_parts_gets_them_as_transformers_does(continued: bool) -> None:
    """vLLM passes the parts on to a template that loops over a message's content; the
    reference is transformers rendering those parts (continuing the last text part)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from ortbatch.serve.served.completions import parse_chat_request, render_bounded

    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "two parts"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "Se"}]}]
    messages = messages if continued else messages[:1]
    flags = {"add_generation_prompt": not continued, "continue_final_message": continued}
    (want,), _ = render_jinja_template(conversations=[messages], chat_template=PARTS, **flags)
    template = ChatTemplate(PARTS)
    assert template.reads_content_parts and not ChatTemplate(CHATML).reads_content_parts
    chat, req = parse_chat_request({"messages": messages, **flags, "echo": True}, template)
    assert render_bounded(template, chat, 2.0, 10**6) == want
    assert want.endswith("[Se" if continued else "[Look:][two parts]</user><assistant>")
    assert req.echo_text == ("Se" if continued else "")


def test_a_legacy_function_call_message_is_refused_not_dropped() -> None:
    """Templates read ``tool_calls``: an assistant turn's deprecated ``function_call`` would
    vanish from the prompt, so it is a 400 naming it."""
    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(InvalidInputError, match=r"messages\[1\]\.function_call") as err:
        _served_prompt(CHATML, [MESSAGES[1], call])
    assert err.value.input_name == "messages[1].function_call"


httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from ortbatch.serve import BackgroundServer, ServedGenerator  # noqa: E402


@pytest.fixture(scope="module")
def chat_export(tiny_gpt2: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat") / "export"
    shutil.copytree(tiny_gpt2.export, out)
    (out / "chat_template.jinja").write_text(CHATML)
    return out


@pytest.fixture(scope="module")
def chat_server(chat_export: Path) -> Iterator[BackgroundServer]:
    with BackgroundServer(ServedGenerator(BatchedGenerator(chat_export, max_batch_size=4), "chat")) as srv:
        yield srv


def test_chat_completion_is_the_rendered_prompt_completed(chat_server: BackgroundServer, chat_export: Path) -> None:
    api = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    messages = MESSAGES[1:2]
    with BatchedGenerator(chat_export, max_batch_size=1) as gen:
        ids = gen.encode(ChatTemplate(CHATML).render(messages), add_special_tokens=False)
        want = gen.generate(ids, 10)
    got = api.chat.completions.create(model="chat", messages=messages, max_tokens=10, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == want.completion_tokens

    chunks = list(
        api.chat.completions.create(
            model="chat", messages=messages, max_completion_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, "string 'role'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        (
            {"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages[0].function_call is not supported",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_bad_chat_requests(chat_server: BackgroundServer, body: dict, message: str) -> None:
    r = httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_export_without_a_template_says_so(tiny_gpt2: TinyModel) -> None:
    with BackgroundServer(ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=2), "plain")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
_content = st.text(max_size=20) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8) | _scalars}),
    max_size=3,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]) | _scalars, "content": _content | _scalars}
)
_chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=4) | _scalars},
    optional={
        "max_tokens": st.integers(-2, 10) | _scalars,
        "max_completion_tokens": st.integers(-2, 10) | _scalars,
        "temperature": st.floats(-1, 3) | _scalars,
        "stream": st.booleans() | _scalars,
        "logprobs": _scalars,
        "tools": st.just([{"type": "function"}]) | _scalars,
    },
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_chat_bodies)
def test_fuzzed_chat_requests_never_fail_the_server(chat_server: BackgroundServer, body: dict) -> None:
    r = httpx.post(chat_server.url + "/v1/chat/completions", content=json.dumps(body), timeout=60)
    assert_openai_answer(r, "chat.completion")


def test_openai_client_example(chat_server: BackgroundServer, chat_export: Path) -> None:
    """examples/openai_client.py (the docs' client example) against a served export."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "openai_client.py"
    spec = importlib.util.spec_from_file_location("openai_client_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with BatchedGenerator(chat_export, max_batch_size=1) as gen:
        want = gen.generate("Once upon a time", 12).text
        want_chat = gen.generate(gen.encode(ChatTemplate(CHATML).render(MESSAGES[1:2]), add_special_tokens=False), 12)
    assert example.complete(chat_server.url, "chat", "Once upon a time", 12) == want
    assert example.stream(chat_server.url, "chat", "Once upon a time", 12)  # sampled (seed 7)
    assert example.chat(chat_server.url, "chat", MESSAGES[1]["content"], 12) == want_chat.text
    with BatchedGenerator(chat_export, max_batch_size=4) as gen:
        context = gen.encode("Once upon a time")
        whole = gen.encode("Once upon a time there was")
        assert whole[: len(context)] == context  # the continuation's tokens follow the context's
        scored = gen.generate(whole, params=SamplingParams(max_new_tokens=0, prompt_logprobs=0))
        drawn = gen.generate_choices(
            "Once upon a time", params=SamplingParams(max_new_tokens=16, temperature=1.0, seed=0, n=3, logprobs=0)
        )
    want_ll = sum(lp.logprob for lp in scored.prompt_logprobs[len(context) :])
    assert example.loglikelihood(chat_server.url, "chat", "Once upon a time", " there was") == pytest.approx(
        want_ll, abs=1e-5
    )
    got = example.samples(chat_server.url, "chat", "Once upon a time")
    assert [t for t, _ in got] == [c.text for c in drawn]
    assert [lp for _, lp in got] == pytest.approx([sum(x.logprob for x in c.logprobs) for c in drawn], abs=1e-4)
