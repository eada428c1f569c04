"""Streaming detokenisation: incremental, equal to decoding the whole output, linear in length."""

from __future__ import annotations

from typing import Any

from tandem import SamplingParams
from tandem.engine.io.output_processor import OutputProcessor
from tandem.engine.request import Request
from tandem.engine.sched.step import RequestUpdate

TEXT = "Grüße, 世界! Emoji 🙂🚀 and code: `x = {'ä': 1}`\n" * 8


def test_streamed_text_is_the_full_decode_with_no_broken_characters(tiny_llm: Any) -> None:
    tokenizer = tiny_llm.engine.tokenizer
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decoded_lengths: list[int] = []
    real_decode = tokenizer.decode

    def counting_decode(ids: list[int], **kwargs: Any) -> str:
        decoded_lengths.append(len(ids))
        return real_decode(ids, **kwargs)

    tokenizer.decode = counting_decode  # type: ignore[method-assign]
    try:
        processor = OutputProcessor(tokenizer)
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=len(token_ids)))
        processor.add(request, None, stream_text=True)
        deltas = []
        for i, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            finished = i == len(token_ids) - 1
            outputs, _ = processor.process([RequestUpdate(request, [token_id], None, finished)])
            deltas.append(outputs[0].outputs[0].delta_text)
    finally:
        del tokenizer.decode
    assert "".join(deltas) == real_decode(token_ids) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    # Linear: each step decodes a short window (the final full decode aside), not the whole output.
    assert sum(decoded_lengths) - len(token_ids) < 6 * len(token_ids), (sum(decoded_lengths), len(token_ids))
