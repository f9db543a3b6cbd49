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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
