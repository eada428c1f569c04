"""Streaming detokenisation: incremental, equal to decoding the whole output, linear in length."""

from __future__ import annotations

from typing import Any

from tandem import SamplingParams
from tandem.engine.io.output_processor import OutputProcessor
from tandem.engine.request import Request, RequestStatus
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


def _stream(
    processor: OutputProcessor, params: SamplingParams, token_ids: list[int]
) -> tuple[list[str], Any]:
    """Feed `token_ids` one step at a time until a stop string or the last token ends the request;
    the running outputs' delta texts and the final output."""
    request = Request("r", [1, 2, 3], params)
    processor.add(request, None, stream_text=True, cumulative=False)
    deltas: list[str] = []
    for i, token_id in enumerate(token_ids):
        request.output_token_ids.append(token_id)
        last = i == len(token_ids) - 1
        if last:  # the scheduler ends it at its length
            request.status = RequestStatus.FINISHED_LENGTH
        outputs, stopped = processor.process([RequestUpdate(request, [token_id], None, last)])
        out = outputs[0]
        deltas.append(out.outputs[0].delta_text)
        if out.finished:
            assert stopped == (["r"] if out.outputs[0].finish_reason == "stop" else [])
            return deltas, out
    raise AssertionError("the request never finished")


def test_stop_strings_end_the_stream_where_the_whole_decode_has_them(tiny_llm: Any) -> None:
    """Streamed deltas with stop strings (held back while they could still become one, searched
    only where one can end) join to the whole decode cut at the earliest stop string, as the final
    output's text: with and without the stop string itself, stops spanning tokens, prefixes of
    one another, and none found."""
    tokenizer = tiny_llm.engine.tokenizer
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = tokenizer.decode(token_ids)
    cases = [
        ["世界! E"],
        ["x = {"],
        ["🚀 and", "Emoji"],
        ["code", "co"],
        ["ä': 1}`\n" + "Gr"],
        ["not in the text"],
    ]
    for stops in cases:
        for include in (False, True):
            params = SamplingParams(max_tokens=len(token_ids), stop=stops, include_stop_str_in_output=include)
            deltas, final = _stream(OutputProcessor(tokenizer), params, token_ids)
            hits = [(full.find(s), s) for s in stops if full.find(s) >= 0]
            if hits:
                position, stop = min(hits)
                expected = full[: position + len(stop) if include else position]
                assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
            else:
                expected = full
                assert final.outputs[0].finish_reason == "length"
            assert "".join(deltas) == expected == final.outputs[0].text, (stops, include)


def test_a_streamed_request_sends_its_prompt_once_across_processes(tiny_llm: Any) -> None:
    """Between processes (`RequestOutput.for_the_wire`, pickled as Ray sends it) a running output
    after the first carries its new tokens, not the prompt: its message does not grow with the
    prompt; the receiver's outputs (`with_prompt_of` the first) are the sender's, field by field."""
    import pickle

    tokenizer = tiny_llm.engine.tokenizer
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)[:12]
    sizes = {}
    for prompt_len in (8, 4000):
        processor = OutputProcessor(tokenizer)
        request = Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=len(token_ids)))
        processor.add(request, "a prompt " * prompt_len, stream_text=True, cumulative=False)
        sent, received = [], []
        first = None
        for i, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            finished = i == len(token_ids) - 1
            (output,), _ = processor.process([RequestUpdate(request, [token_id], None, finished)])
            message = pickle.dumps(output.for_the_wire(first=first is None))
            sent.append((pickle.loads(pickle.dumps(output)), len(message)))  # as it is now
            out = pickle.loads(message)
            first = first or out
            received.append(out.with_prompt_of(first))
        for (mine, _), theirs in zip(sent, received, strict=True):
            assert theirs == mine
        assert received[-1].outputs[0].token_ids == token_ids  # the final output whole
        sizes[prompt_len] = [size for _, size in sent]
    # the first and the final message carry the prompt; those between are the same size either way
    assert sizes[4000][0] > sizes[8][0] + 4000 and sizes[4000][-1] > sizes[8][-1] + 4000
    assert sizes[4000][1:-1] == sizes[8][1:-1]
