"""Issue 28, acceptance 1, over the server: requests sent to ``ortbatch serve``'s
``/v1/completions`` and ``/v1/chat/completions`` at once, decoded in one batch of mixed rows.

Greedy rows with each penalty, ``min_tokens``, ``logit_bias`` and ``stop_token_ids`` give the
tokens of ``model.generate`` with the matching transformers ``LogitsProcessor``; plain rows
beside them give what they give alone; every logprob shown (Completions' ``token_logprobs`` and
``top_logprobs``, Chat's ``content``, ``echo``'s prompt logprobs with ``max_tokens: 0``) equals
``log_softmax`` of the PyTorch model's logits to 1e-4.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation.chat import ChatTemplate

from .conftest import EOS, TinyModel
from .test_sampling_parity import NEW, PROMPTS, cases, hf_generate, hf_logprobs

pytestmark = [pytest.mark.export]
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from ortbatch.serve import BackgroundServer, ServedGenerator  # noqa: E402

CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields as the request spells them (logit_bias keys are strings)."""
    out = dict(fields)
    if "logit_bias" in out:
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


def _held(gen: BatchedGenerator, requests: list[tuple[str, dict[str, Any]]], url: str) -> list[dict[str, Any]]:
    """POST every request while a one-token blocker holds the step loop, so they are all queued
    before any is admitted (then prefilled and decoded together). Their JSON answers."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_token: object) -> None:
        entered.set()
        gate.wait(60)

    blocker = gen.submit([5, 6], 1, on_token=hold)
    assert entered.wait(30)
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(httpx.post, url + path, json=body, timeout=120) for path, body in requests]
        deadline = time.monotonic() + 60
        while gen.stats().queued < len(requests) and time.monotonic() < deadline:
            time.sleep(0.01)  # the HTTP requests reach the queue (the gate holds them there)
        assert gen.stats().queued == len(requests)
        gate.set()
        blocker.result(30)
        answers = [f.result() for f in futures]
    for a in answers:
        assert a.status_code == 200, a.text
    return [a.json() for a in answers]


@pytest.fixture
def chat_export(tiny: TinyModel, tmp_path: Path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(tiny.export, out)
    (out / "chat_template.jinja").write_text(CHATML)
    return out


def test_mixed_requests_over_http_match_transformers(tiny: TinyModel, chat_export: Path, no_thread_leak: None) -> None:
    requests: list[tuple[str, dict[str, Any]]] = []
    expected: list[tuple[str, list[int]]] = []
    base = {"max_tokens": NEW, "temperature": 0, "return_token_ids": True}
    for k, (name, fields, processors, eos) in enumerate(cases(tiny)):
        prompt = PROMPTS[k % len(PROMPTS)] if name != "stop_token_ids" else PROMPTS[5]
        requests.append(("/v1/completions", {"prompt": prompt, **base, **_body(fields)}))
        expected.append((name, hf_generate(tiny, prompt, NEW, processors(prompt), eos)))
        plain = PROMPTS[(k + 3) % len(PROMPTS)]  # a plain row between each pair
        requests.append(("/v1/completions", {"prompt": plain, **base}))
        expected.append(("plain", tiny.reference(plain, NEW)))
    template = ChatTemplate(CHATML)
    logprob_rows = [
        ("/v1/completions", {"prompt": PROMPTS[0], **base, "logprobs": 5}),
        ("/v1/completions", {"prompt": PROMPTS[3], **base, "logprobs": 3, "repetition_penalty": 2.0}),
        ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, **base, "logprobs": True, "top_logprobs": 4}),
    ]
    gen = BatchedGenerator(chat_export, max_batch_size=len(requests) + len(logprob_rows))
    with BackgroundServer(ServedGenerator(gen, "m")) as srv:
        answers = _held(gen, requests + logprob_rows, srv.url)
        assert gen.stats().max_decode_rows >= len(requests)  # decoded together
        chat_ids = gen.encode(template.render(MESSAGES), add_special_tokens=False)
    for (name, want), answer in zip(expected, answers, strict=False):
        assert answer["choices"][0]["token_ids"] == want, name
    for (name, want), (_, body) in zip(expected[::2], requests[::2], strict=True):
        assert want != tiny.reference(body["prompt"], NEW), name  # each processor changed what greedy gives
    completions, penalised, echo, chat = answers[len(requests) :]
    _check_completion_logprobs(tiny, PROMPTS[0], completions, 5)
    _check_completion_logprobs(tiny, PROMPTS[3], penalised, 3)
    _check_echo(tiny, PROMPTS[1], echo, 2)
    _check_chat_logprobs(tiny, chat_ids, chat, 4)


def _decoded(tiny: TinyModel, ids: list[int]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.source)
    return [tok.decode([i]) for i in ids]


def _check_completion_logprobs(tiny: TinyModel, prompt: list[int], answer: dict[str, Any], k: int) -> None:
    choice = answer["choices"][0]
    out, lp = choice["token_ids"], choice["logprobs"]
    ref = hf_logprobs(tiny, [*prompt, *out])
    names = _decoded(tiny, out)
    assert lp["tokens"] == names
    for t, token in enumerate(out):
        row = ref[len(prompt) - 1 + t]
        assert abs(lp["token_logprobs"][t] - row[token]) < 1e-4
        order = np.argsort(-row, kind="stable")[:k]
        top = lp["top_logprobs"][t]
        # tokens with the same text (partial UTF-8 characters) share a key: the most likely one's
        seen: dict[str, float] = {}
        for i, name in zip(order, _decoded(tiny, order.tolist()), strict=True):
            seen.setdefault(name, float(row[i]))
        seen.setdefault(names[t], float(row[token]))
        assert top.keys() == seen.keys()
        np.testing.assert_allclose([top[n] for n in seen], list(seen.values()), atol=1e-4)


def _check_echo(tiny: TinyModel, prompt: list[int], answer: dict[str, Any], k: int) -> None:
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    ref = hf_logprobs(tiny, prompt)
    assert answer["usage"]["completion_tokens"] == 0 and lp["tokens"] == _decoded(tiny, prompt)
    assert lp["token_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:])
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=1e-4)


def _check_chat_logprobs(tiny: TinyModel, prompt: list[int], answer: dict[str, Any], k: int) -> None:
    choice = answer["choices"][0]
    out, content = choice["token_ids"], choice["logprobs"]["content"]
    ref = hf_logprobs(tiny, [*prompt, *out])
    for t, (token, item) in enumerate(zip(out, content, strict=True)):
        row = ref[len(prompt) - 1 + t]
        assert abs(item["logprob"] - row[token]) < 1e-4
        order = np.argsort(-row, kind="stable")[:k]
        np.testing.assert_allclose([x["logprob"] for x in item["top_logprobs"]], row[order], atol=1e-4)
    # the tokens' own bytes make the text (eos, a special token, is left out of the text)
    joined = b"".join(bytes(c["bytes"]) for c, t in zip(content, out, strict=True) if t != EOS)
    assert joined.decode("utf-8", "replace") == choice["message"]["content"]
