"""Talk to `ortbatch serve` (a text-generation export) with the official OpenAI client.

    ortbatch export tiny:gpt2 -o exports/tiny-gpt2      # offline; or a real one, e.g. gpt2
    ortbatch serve exports/tiny-gpt2 &
    python examples/openai_client.py http://127.0.0.1:8000 tiny-gpt2

Every request below joins the server's one BatchedGenerator: concurrent clients share
decode steps (continuous batching) and each gets exactly its own answer.
"""

from __future__ import annotations

import sys

from openai import OpenAI


def complete(base_url: str, model: str, prompt: str, max_tokens: int = 32) -> str:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def stream(base_url: str, model: str, prompt: str, max_tokens: int = 32) -> str:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    text = ""
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, seed=7):
        text += chunk.choices[0].text
        print(chunk.choices[0].text, end="", flush=True)
    print()
    return text


def chat(base_url: str, model: str, question: str, max_tokens: int = 32) -> str:
    """Needs an export with a chat template (`ortbatch export` copies the tokenizer's)."""
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content or ""


def loglikelihood(base_url: str, model: str, context: str, continuation: str) -> float:
    """log P(continuation | context): the prompt scored, nothing generated (``echo`` +
    ``logprobs`` + ``max_tokens: 0``, what lm-evaluation-harness's loglikelihood sends). The
    continuation's tokens are those that start where the context ends (``text_offset``)."""
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    out = client.completions.create(model=model, prompt=context + continuation, max_tokens=0, echo=True, logprobs=0)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.text_offset is not None and lp.token_logprobs is not None
    return sum(
        v for at, v in zip(lp.text_offset, lp.token_logprobs, strict=True) if at >= len(context) and v is not None
    )


def samples(
    base_url: str, model: str, prompt: str, n: int = 3, max_tokens: int = 16, seed: int = 0
) -> list[tuple[str, float]]:
    """``n`` sampled completions of one prompt (prefilled once), each with the sum of its tokens'
    logprobs; the same ``seed`` gives the same ``n`` again."""
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, n=n, seed=seed, logprobs=1)
    return [(c.text, sum(c.logprobs.token_logprobs or []) if c.logprobs else 0.0) for c in out.choices]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python examples/openai_client.py URL MODEL\n"
            "  e.g. python examples/openai_client.py http://127.0.0.1:8000 tiny-gpt2\n"
            "  (URL of a running `ortbatch serve`; MODEL is its model name, the export directory's name)",
            file=sys.stderr,
        )
        return 2
    url, name = argv
    print(complete(url, name, "Once upon a time"))
    stream(url, name, "The quick brown fox")
    print(loglikelihood(url, name, "Once upon a time", " there was"))
    for text, logprob in samples(url, name, "Once upon a time"):
        print(f"{logprob:8.3f} {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
