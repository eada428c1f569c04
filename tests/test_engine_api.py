"""The public engine API on a small random model: sampling options, stops, errors, preemption."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from tandem import LLM, AsyncEngine, GenerationRequest, SamplingParams
from tandem.platform.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError

PROMPTS = ["The quick brown fox", "Paged attention stores", "numbers and words", "Hello there"]


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_generate_returns_in_order_with_text_matching_tokens(tiny_llm: LLM) -> None:
    outs = tiny_llm.generate(PROMPTS, greedy(8))
    assert [o.prompt for o in outs] == PROMPTS
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == tiny_llm.tokenizer.decode(c.token_ids)
    stats = tiny_llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_capacity_tokens"] == stats["kv_blocks_total"] * stats["block_size"]


def test_seeded_sampling_reproducible_and_independent_of_batch(tiny_llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    in_batch = tiny_llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    other_seed = tiny_llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert alone == in_batch
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_string_truncates_and_reports_reason(tiny_llm: LLM) -> None:
    base = tiny_llm.generate([PROMPTS[1]], greedy(16))[0].outputs[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = tiny_llm.generate([PROMPTS[1]], greedy(16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.index(stop)]
    kept = tiny_llm.generate([PROMPTS[1]], greedy(16, stop=[stop], include_stop_str_in_output=True))[
        0
    ].outputs[0]
    assert kept.text == base[: base.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(tiny_llm: LLM) -> None:
    base = tiny_llm.generate([PROMPTS[2]], greedy(10))[0].outputs[0].token_ids
    out = tiny_llm.generate([PROMPTS[2]], greedy(10, stop_token_ids=[base[3]]))[0].outputs[0]
    assert out.token_ids == base[: base.index(base[3]) + 1] and out.stop_reason == base[3]
    inputs = tiny_llm.engine.input_processor  # what makes each request's stop set
    saved = inputs.eos_token_ids
    inputs.eos_token_ids = frozenset({base[0]})
    try:
        stopped = tiny_llm.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[
            0
        ]
        ignored = tiny_llm.generate([PROMPTS[2]], greedy(10))[0].outputs[0]
    finally:
        inputs.eos_token_ids = saved
    assert stopped.token_ids == base[:1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == base and ignored.finish_reason == "length"


def test_logprobs_are_top_n_and_include_the_chosen_token(tiny_llm: LLM) -> None:
    out = tiny_llm.generate([PROMPTS[0]], greedy(5, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry and len(entry) == 3  # greedy: the chosen one is the top one
        assert entry[token_id] == max(entry.values()) and all(v <= 0 for v in entry.values())


def test_frequency_penalty_reduces_repetition(tiny_llm: LLM) -> None:
    plain = tiny_llm.generate([PROMPTS[3]], greedy(40))[0].outputs[0].token_ids
    penalised = (
        tiny_llm.generate([PROMPTS[3]], greedy(40, frequency_penalty=2.0, presence_penalty=2.0))[0]
        .outputs[0]
        .token_ids
    )
    assert penalised[0] == plain[0]  # nothing generated yet: no penalty on the first token
    assert max(Counter(penalised).values()) < max(Counter(plain).values())


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_bad_prompts_raise_before_allocation_and_engine_keeps_serving(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny_llm.generate([""], greedy(4))
    assert info.value.param == "prompt"
    too_long = [1] * tiny_llm.engine.max_model_len
    with pytest.raises(ContextLengthExceededError):
        tiny_llm.generate([PROMPTS[0], too_long], greedy(4))  # one bad prompt: nothing is queued
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[10**9]], greedy(4))
    assert tiny_llm.stats()["kv_blocks_used"] == 0 and tiny_llm.stats()["num_waiting"] == 0
    assert len(tiny_llm.generate([PROMPTS[0]], greedy(4))[0].outputs[0].token_ids) == 4


def test_unknown_and_corrupt_models_give_clear_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        LLM(str(broken))
    gguf_file = tmp_path / "bad.gguf"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(gguf_file))


def test_engine_options_are_validated() -> None:
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="no_such_option"):
        LLM(no_such_option=1)


def test_preemption_and_chunked_prefill_keep_greedy_outputs(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    prompts = [p * 3 for p in PROMPTS] * 2
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, greedy(40))]
    # 24 blocks of 4 tokens: 8 requests of ~60 tokens cannot all stay resident.
    small = LLM(
        str(tiny_model_dir),
        kv_cache_memory=24 * 4 * 2 * 3 * 2 * 16 * 4,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=96,
    )
    assert small.stats()["kv_blocks_total"] == 24
    outs = small.generate(prompts, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.stats()["num_preemptions"] > 0
    assert small.stats()["kv_blocks_used"] == 0


def test_chat_uses_the_template(tiny_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    out = tiny_llm.chat(messages, greedy(4))[0]
    assert out.prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(InvalidRequestError, match="no content"):
        tiny_llm.chat([{"role": "user", "content": ""}], greedy(4))


def test_async_engine_streams_deltas_and_abort_frees_blocks(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    expected = tiny_llm.generate([PROMPTS[0]], greedy(20))[0].outputs[0]

    async def scenario() -> None:
        engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20)
        try:
            text, ids, finals = "", [], []
            async for out in engine.generate(
                GenerationRequest("r1", prompt=PROMPTS[0], sampling_params=greedy(20))
            ):
                text += out.outputs[0].delta_text
                ids += out.outputs[0].delta_token_ids
                finals.append(out.finished)
            assert ids == expected.token_ids and text == expected.text
            # One output per token unless the consumer lagged and updates were merged.
            assert finals[-1] and not any(finals[:-1]) and 1 < len(finals) <= 20

            stream = engine.generate(GenerationRequest("r2", prompt=PROMPTS[1], sampling_params=greedy(200)))
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await stream.aclose()  # what a client disconnect does: aborts r2
            # Any request that completes afterwards ran after the abort was applied.
            async for _ in engine.generate(
                GenerationRequest("r3", prompt=PROMPTS[2], sampling_params=greedy(2))
            ):
                pass
            assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0

            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate(GenerationRequest("r4", prompt="", sampling_params=greedy(2))):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_a_request_that_does_not_stream_gets_its_first_and_final_outputs_only(
    tiny_model_dir: Path, tiny_llm: LLM
) -> None:
    """`GenerationRequest.stream=False` (non-streaming API calls, batch lines): two messages, not
    one per token, and the final one is the whole answer, also when a stop string ends it."""
    expected = tiny_llm.generate([PROMPTS[0]], greedy(20))[0].outputs[0]
    stop = expected.text[len(expected.text) // 2 : len(expected.text) // 2 + 3]
    stopped = tiny_llm.generate([PROMPTS[0]], greedy(20, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop"

    async def collect(request: GenerationRequest, engine: AsyncEngine) -> list:  # type: ignore[type-arg]
        return [out async for out in engine.generate(request)]

    async def scenario() -> None:
        engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20)
        try:
            streamed, quiet, quiet_stopped = await asyncio.gather(
                collect(GenerationRequest("s", prompt=PROMPTS[0], sampling_params=greedy(20)), engine),
                collect(
                    GenerationRequest("q", prompt=PROMPTS[0], sampling_params=greedy(20), stream=False),
                    engine,
                ),
                collect(
                    GenerationRequest(
                        "qs", prompt=PROMPTS[0], sampling_params=greedy(20, stop=[stop]), stream=False
                    ),
                    engine,
                ),
            )
        finally:
            engine.shutdown()
        assert len(streamed) > 2  # the streaming neighbour still gets its tokens as they come
        for outs, want in ((quiet, expected), (quiet_stopped, stopped)):
            assert len(outs) == 2 and not outs[0].finished and outs[1].finished
            assert len(outs[0].outputs[0].token_ids) < len(want.token_ids)
            final = outs[1].outputs[0]
            assert (final.token_ids, final.text, final.finish_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
            )

    asyncio.run(scenario())


def test_a_deltas_only_request_streams_what_is_new_and_ends_whole(tiny_llm: LLM) -> None:
    """`GenerationRequest.cumulative=False` (the serving path): running outputs carry only their
    deltas (no copy of the output so far each step); their concatenation and the final output,
    which carries everything, equal the cumulative request's answer: tokens, text, logprobs."""
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    for request_id, cumulative in (("whole", True), ("deltas", False)):
        engine.add_request(
            GenerationRequest(request_id, prompt=PROMPTS[1], sampling_params=params, cumulative=cumulative),
            stream_text=True,
        )
    running: dict[str, list] = {"whole": [], "deltas": []}  # type: ignore[type-arg]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            (completion,) = out.outputs
            if out.finished:
                finals[out.request_id] = completion
            else:
                running[out.request_id].append(completion)
    assert len(running["deltas"]) > 3
    assert all(c.text == "" and c.token_ids == [] and c.logprobs is None for c in running["deltas"])
    assert running["whole"][-1].token_ids and running["whole"][-1].text  # the default: cumulative
    whole, deltas = finals["whole"], finals["deltas"]
    assert (deltas.token_ids, deltas.text, deltas.logprobs) == (whole.token_ids, whole.text, whole.logprobs)
    streamed = [*running["deltas"], deltas]
    assert sum((c.delta_token_ids for c in streamed), []) == whole.token_ids
    assert "".join(c.delta_text for c in streamed) == whole.text
    assert sum((c.delta_logprobs or [] for c in streamed), []) == whole.logprobs


def test_async_engine_survives_a_consumer_whose_event_loop_closed(tiny_model_dir: Path) -> None:
    """A caller's event loop closes while its request still runs (a test client torn down, a
    worker killed mid-request): the engine aborts that request and keeps serving others."""
    import asyncio

    engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20)
    try:
        loop = asyncio.new_event_loop()
        orphan = engine.generate(GenerationRequest("orphan", prompt=PROMPTS[0], sampling_params=greedy(300)))
        loop.run_until_complete(anext(orphan))  # running; its consumer then disappears
        loop.close()

        async def next_request() -> list[int]:
            ids: list[int] = []
            async for out in engine.generate(
                GenerationRequest("next", prompt=PROMPTS[1], sampling_params=greedy(5))
            ):
                ids += out.outputs[0].delta_token_ids
            return ids

        assert len(asyncio.run(asyncio.wait_for(next_request(), 60))) == 5  # a dead engine loop would hang
        assert engine.is_alive()
        deadline = time.monotonic() + 30
        while engine.stats()["num_running"] or engine.stats()["num_waiting"]:  # the orphan gets aborted
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.shutdown()


def test_requests_reaching_an_idle_engine_together_are_prefilled_in_one_step(tiny_model_dir: Path) -> None:
    """A burst reaches the engine spread over time (HTTP parsing, routing). With the admission
    window, a request arriving 0.2 s after the first joins its first step; without it the first
    request's step would start alone at once. The window also stays bounded."""

    async def first_scheduled(engine: AsyncEngine, request_id: str, delay_s: float) -> float:
        await asyncio.sleep(delay_s)  # the arrival gap under test, not synchronisation
        last = None
        async for out in engine.generate(
            GenerationRequest(request_id, prompt=PROMPTS[0], sampling_params=greedy(2))
        ):
            last = out
        assert last is not None and last.metrics.first_scheduled_time is not None
        return last.metrics.first_scheduled_time - last.metrics.arrival_time + delay_s

    async def burst(engine: AsyncEngine) -> list[float]:
        return list(
            await asyncio.gather(first_scheduled(engine, "a", 0.0), first_scheduled(engine, "b", 0.2))
        )

    engine = AsyncEngine.from_options(
        str(tiny_model_dir), kv_cache_memory=4 << 20, admission_wait_ms=3000, admission_max_wait_ms=3000
    )
    try:
        steps_before = engine.engine.num_steps
        started_a, started_b = asyncio.run(burst(engine))
        # Both first scheduled by one step: the same moment, measured from a's arrival.
        assert abs(started_a - started_b) < 0.1 and started_a >= 0.2
        assert engine.engine.num_steps - steps_before == 2  # one joint prefill step, one decode step
        stats = engine.stats()
        assert stats["step_wall_s"] > 0 and 0 < stats["step_thread_cpu_s"] <= stats["step_wall_s"] * 1.5
    finally:
        engine.shutdown()

    bounded = AsyncEngine.from_options(
        str(tiny_model_dir), kv_cache_memory=4 << 20, admission_wait_ms=60_000, admission_max_wait_ms=100
    )
    try:  # a quiet window of a minute is cut at the 0.1 s cap
        queued = asyncio.run(asyncio.wait_for(first_scheduled(bounded, "c", 0.0), 30))
        assert 0.09 <= queued < 10
    finally:
        bounded.shutdown()


def test_top_p_alone_filters_sampling(tiny_llm: LLM) -> None:
    """Only `top_p` set (temperature 1, no top_k/min_p): a nucleus this small keeps only the most
    likely token, so sampling gives the greedy tokens, whatever the seed."""
    prompt = [[5, 6, 7, 8, 9]]
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for seed in (1, 2, 3):
        nucleus = tiny_llm.generate(
            prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=seed, ignore_eos=True)
        )
        assert nucleus[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_a_vanishing_temperature_is_greedy_not_an_error(tiny_llm: LLM) -> None:
    """Dividing logits by 1e-300 overflows to inf (the fuzzer found it): such a temperature is greedy."""
    prompt = [[5, 6, 7, 8, 9]]
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True))
    assert tiny[0].outputs[0].finish_reason == "length"
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
