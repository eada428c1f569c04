"""`tandem generate`: stream one prompt's reply to stdout (the chat template unless `--raw`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tandem.platform.config import DEFAULT_MODEL


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument(
        "--top-p", type=float, default=None, help="default: the model's generation default, else 1"
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import LLM
    from tandem.engine.protocol import RequestOutput
    from tandem.engine.sampling_params import SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed)
    print(f"[tandem] loaded {args.model} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    unset = {"top_k", "min_p", "repetition_penalty"} | ({"top_p"} if args.top_p is None else set())
    params = SamplingParams(  # what the flags leave unset, the checkpoint's generation defaults fill
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed, model_defaults=frozenset(unset),
    )  # fmt: skip

    def show(output: RequestOutput) -> None:
        sys.stdout.write(output.outputs[0].delta_text)
        sys.stdout.flush()

    use_chat = not args.raw and llm.tokenizer.chat_template is not None
    started = time.monotonic()
    if use_chat:
        from tandem.engine.protocol import GenerationRequest

        request = GenerationRequest(
            request_id=llm.engine.new_request_id(),
            messages=[{"role": "user", "content": args.prompt}],
            sampling_params=params,
        )
        results = llm._run([request], show)
    else:
        results = llm.generate([args.prompt], params, on_output=show)
    elapsed = time.monotonic() - started
    out = results[0].outputs[0]
    sys.stdout.write("\n")
    ttft = results[0].metrics.ttft or 0.0
    print(
        f"[tandem] {len(out.token_ids)} tokens in {elapsed:.2f}s ({len(out.token_ids) / max(elapsed, 1e-9):.1f} tok/s), "
        f"ttft {ttft * 1000:.0f} ms, finish_reason={out.finish_reason}",
        file=sys.stderr,
    )
    return 0
