"""KV hand-over between engines (prefill -> decode): identical greedy output, verified pages,
nothing leaked on failure."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from tandem import GenerationRequest, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.kv.transfer import KVTransfer, KVTransferError

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13] * 3, [40, 41, 42], [7] * 17]


def engine(model_dir: Path, **options: object) -> LLMEngine:
    return LLMEngine.from_options(
        str(model_dir), kv_cache_memory=4 << 20, block_size=4, speculative=None, **options
    )


def run(engine_: LLMEngine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def prefill(
    sender: LLMEngine, request_id: str, prompt: list[int], cache_dtype: str | None = None
) -> KVTransfer:
    sender.add_prefill_request(GenerationRequest(request_id, prompt_token_ids=prompt, sampling_params=PARAMS))
    run(sender)
    return sender.handover.export_kv(request_id, cache_dtype)


PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("decode_cache", ["auto", "fp8_e4m3"])
def test_handed_over_requests_decode_as_colocated_ones(tiny_model_dir: Path, decode_cache: str) -> None:
    """Prefill on a float32 engine, decode on another (float32, or FP8: the pages are sent as
    FP8, half the bytes): the tokens equal those of one engine with the decode side's cache. Not
    batch-invariant: there an FP8 engine's prompt attends its keys as cached (FP8), which a float32
    sender does not; here both compute the first token from unrounded keys."""
    colocated = engine(tiny_model_dir, kv_cache_dtype=decode_cache, batch_invariant=False)
    for i, prompt in enumerate(PROMPTS):
        colocated.add_request(GenerationRequest(f"r{i}", prompt_token_ids=prompt, sampling_params=PARAMS))
    want = run(colocated)

    sender = engine(tiny_model_dir, batch_invariant=False)
    receiver = engine(tiny_model_dir, kv_cache_dtype=decode_cache, batch_invariant=False)
    fp8 = decode_cache == "fp8_e4m3"
    firsts = {}
    for i, prompt in enumerate(PROMPTS):
        transfer = prefill(sender, f"r{i}", prompt, "float8_e4m3fn" if fp8 else None)
        if fp8:
            full = prefill(sender, f"f{i}", prompt)  # the same pages in float32, to compare sizes
            assert transfer.num_bytes < 0.3 * full.num_bytes
        first = receiver.handover.add_request_with_kv(
            GenerationRequest(f"r{i}", prompt_token_ids=prompt, sampling_params=PARAMS), transfer
        )
        firsts[f"r{i}"] = first.outputs[0].token_ids
    got = run(receiver)
    assert got == want
    assert all(firsts[rid] == want[rid][:1] for rid in want)
    assert sender.stats()["kv_blocks_used"] == 0 and receiver.stats()["kv_blocks_used"] == 0


def test_bad_transfers_fail_their_request_and_allocate_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    sender, receiver = engine(tiny_model_dir), engine(tiny_model_dir)
    prompt = PROMPTS[0]
    good = prefill(sender, "r", prompt)
    gen = GenerationRequest("r", prompt_token_ids=prompt, sampling_params=PARAMS)
    page = good.pages[2]
    flipped = bytes([page.data[0] ^ 1]) + page.data[1:]
    bad_transfers = {
        "checksum": dataclasses.replace(
            good, pages=(*good.pages[:2], dataclasses.replace(page, data=flipped), *good.pages[3:])
        ),
        "arrived where": dataclasses.replace(good, pages=(good.pages[1], good.pages[0], *good.pages[2:])),
        "other tokens": prefill(sender, "other", [9] * len(prompt)),
        "tokens": dataclasses.replace(good, pages=good.pages[:-1]),
        "another model": dataclasses.replace(good, model_fingerprint="other|layers=1"),
        "holds float8": prefill(sender, "fp8", prompt, "float8_e4m3fn"),
    }
    for expected, transfer in bad_transfers.items():
        with pytest.raises(KVTransferError, match=expected) as info:
            receiver.handover.add_request_with_kv(gen, transfer)
        assert info.value.code == "kv_transfer_invalid"
        assert receiver.stats()["kv_blocks_used"] == 0 and not receiver.has_unfinished_requests()
    assert sender.stats()["kv_blocks_used"] == 0  # every export freed the sender's blocks
    # The good one still works, and is then decoded to the end.
    receiver.handover.add_request_with_kv(gen, good)
    assert len(run(receiver)["r"]) == PARAMS.max_tokens


def test_held_prefill_blocks_are_freed_when_nobody_collects_them(tiny_model_dir: Path) -> None:
    sender = engine(tiny_model_dir, kv_hold_ttl_s=1e-9)
    sender.add_prefill_request(GenerationRequest("r", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS))
    run(sender)
    assert sender.stats()["kv_blocks_used"] > 0  # held for the hand-over
    sender.step()  # the lease has run out: the next step frees them
    assert sender.stats()["kv_blocks_used"] == 0
    with pytest.raises(Exception, match="no prefilled KV is held"):
        sender.handover.export_kv("r")


def test_async_engines_hand_over_and_stream(tiny_model_dir: Path) -> None:
    """`AsyncEngine.prefill` on one engine, `generate_from_kv` on another: the streamed tokens are
    those of one engine alone; a corrupted transfer raises before any output; leaving the stream
    early aborts the request and frees its blocks."""
    import asyncio

    from tandem import AsyncEngine

    colocated = engine(tiny_model_dir)
    colocated.add_request(GenerationRequest("r", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS))
    want = run(colocated)["r"]
    sender, receiver = AsyncEngine(engine(tiny_model_dir)), AsyncEngine(engine(tiny_model_dir))

    async def main() -> None:
        gen = GenerationRequest("r", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS)
        transfer = await sender.prefill(gen)
        tokens = [
            t
            async for out in receiver.generate_from_kv(gen, transfer)
            for t in out.outputs[0].delta_token_ids
        ]
        assert tokens == want
        broken = dataclasses.replace(transfer, pages=transfer.pages[1:])
        with pytest.raises(KVTransferError):
            async for _ in receiver.generate_from_kv(dataclasses.replace(gen, request_id="b"), broken):
                pass
        early = dataclasses.replace(gen, request_id="early")
        async for _ in receiver.generate_from_kv(early, await sender.prefill(early)):
            break  # the consumer leaves after the first token: the request is aborted

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 5  # the engine threads apply the abort between steps
        while receiver.stats()["kv_blocks_used"] or sender.stats()["kv_blocks_used"]:
            assert time.monotonic() < deadline, (receiver.stats(), sender.stats())
    finally:
        sender.shutdown()
        receiver.shutdown()


def wait_for_baseline(*engines: Any) -> None:
    """Until no engine holds a KV block (their loop threads apply aborts between steps)."""
    deadline = time.monotonic() + 5
    while any(engine.stats()["kv_blocks_used"] for engine in engines):
        assert time.monotonic() < deadline, [engine.stats()["kv_blocks_used"] for engine in engines]


class FlakyPrefillPool:
    """Stands in for the prefill deployment's handle: its first `num_deaths` calls fail as a dead
    replica does (`ActorDiedError`), the rest reach a real prefill engine."""

    def __init__(self, replica: object, num_deaths: int) -> None:
        self.replica, self.num_deaths, self.num_calls = replica, num_deaths, 0
        self.prefill = self
        self.skip_pages: list[int] = []
        self.evict_before_import: Any = None

    async def _call(self, request: GenerationRequest, cache_dtype: str | None, skip_pages: int) -> KVTransfer:
        from ray.exceptions import ActorDiedError

        self.num_calls += 1
        self.skip_pages.append(skip_pages)
        if self.num_calls <= self.num_deaths:
            raise ActorDiedError()
        if self.evict_before_import is not None:  # the receiver's cache loses the prefix meanwhile
            self.evict_before_import()
            self.evict_before_import = None
        return await self.replica.prefill(request, cache_dtype, skip_pages)  # type: ignore[attr-defined]

    def remote(self, request: GenerationRequest, cache_dtype: str | None, skip_pages: int = 0) -> object:
        return self._call(request, cache_dtype, skip_pages)


@pytest.mark.parametrize("num_deaths", [1, 2])
def test_a_dead_prefill_replica_is_retried_once_then_the_request_fails_clearly(
    tiny_model_dir: Path, num_deaths: int
) -> None:
    """The decode replica's orchestration (no Ray needed: the handle is faked): one prefill
    replica dying is retried on another and the answer is right; two in a row fail the request
    with a 503 `prefill_failed`. Blocks return to baseline on both sides either way."""
    import asyncio

    from tandem.deployments.replicas import DecodeReplica, PrefillReplica
    from tandem.platform.errors import ServiceUnavailableError

    options = {"model": str(tiny_model_dir), "kv_cache_memory": 4 << 20, "block_size": 4, "speculative": None}
    colocated = engine(tiny_model_dir)
    colocated.add_request(GenerationRequest("r", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS))
    want = run(colocated)["r"]
    prefill = PrefillReplica({**options, "weight_dtype": "auto", "kv_cache_dtype": "auto"})
    pool = FlakyPrefillPool(prefill, num_deaths)
    decode = DecodeReplica(pool, {**options, "weight_dtype": "auto", "kv_cache_dtype": "auto"})  # type: ignore[arg-type]

    async def main() -> list[int]:
        gen = GenerationRequest("r", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS)
        return [t async for out in decode.stream(gen) for t in out.outputs[0].delta_token_ids]

    try:
        if num_deaths == 1:
            assert asyncio.run(main()) == want
        else:
            with pytest.raises(ServiceUnavailableError) as info:
                asyncio.run(main())
            assert info.value.code == "prefill_failed"
        assert pool.num_calls == 2
        wait_for_baseline(decode.engine, prefill.engine)
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()


def test_pages_in_the_receivers_prefix_cache_are_not_sent_again(tiny_model_dir: Path) -> None:
    """A receiver that holds a prompt's first pages in its prefix cache is sent only the rest;
    the output equals a colocated engine's; pages evicted between the question and the import
    make the import fail cleanly (KVPrefixEvictedError: ask for a whole transfer), and a
    transfer whose skip count is tampered with fails its checks."""
    from tandem.engine.kv.transfer import KVPrefixEvictedError

    shared = PROMPTS[0][:28]
    warm, prompt = [*shared, 90, 91, 92], [*shared, 50, 51, 52]
    colocated = engine(tiny_model_dir)
    colocated.add_request(GenerationRequest("r", prompt_token_ids=prompt, sampling_params=PARAMS))
    want = run(colocated)["r"]

    sender = engine(tiny_model_dir)
    receiver = engine(tiny_model_dir)
    receiver.add_request(GenerationRequest("warm", prompt_token_ids=warm, sampling_params=PARAMS))
    run(receiver)
    gen = GenerationRequest("r", prompt_token_ids=prompt, sampling_params=PARAMS)
    skip = receiver.handover.cached_prefix_pages(gen)
    assert skip == len(shared) // 4
    whole = prefill(sender, "whole", prompt)
    sender.add_prefill_request(dataclasses.replace(gen))
    run(sender)
    partial = sender.handover.export_kv("r", skip_pages=skip)
    assert [p.index for p in partial.pages] == list(range(skip, len(whole.pages)))
    assert partial.num_bytes * whole.num_tokens == whole.num_bytes * partial.num_tokens  # per token alike
    tampered = dataclasses.replace(partial, num_skipped_pages=skip - 1)
    with pytest.raises(KVTransferError):
        receiver.handover.add_request_with_kv(gen, tampered)
    first = receiver.handover.add_request_with_kv(gen, partial)
    got = run(receiver)["r"]
    assert first.outputs[0].token_ids + got[1:] == want and got == want
    assert receiver.stats()["kv_blocks_used"] == 0

    # Evicted meanwhile: nothing is allocated, and a whole transfer then works.
    again = GenerationRequest("r2", prompt_token_ids=prompt, sampling_params=PARAMS)
    skip = receiver.handover.cached_prefix_pages(again)
    assert skip > 0
    sender.add_prefill_request(again)
    run(sender)
    partial = sender.handover.export_kv("r2", skip_pages=skip)
    receiver.kv_manager.pool.reset_prefix_cache()
    with pytest.raises(KVPrefixEvictedError) as info:
        receiver.handover.add_request_with_kv(again, partial)
    assert info.value.code == "kv_prefix_evicted" and info.value.status_code == 503
    assert receiver.stats()["kv_blocks_used"] == 0 and not receiver.has_unfinished_requests()
    receiver.handover.add_request_with_kv(again, prefill(sender, "r2", prompt))
    assert run(receiver)["r2"] == want
    assert sender.stats()["kv_blocks_used"] == 0 and receiver.stats()["kv_blocks_used"] == 0


def test_the_decode_replica_skips_cached_pages_and_recovers_from_their_eviction(tiny_model_dir: Path) -> None:
    """The decode replica's orchestration (handle faked, engines real): it asks for the prompt
    pages its prefix cache lacks; when the cache loses them before the import, it asks once more
    for all of them, and the answer is still right. Blocks return to baseline on both sides."""
    import asyncio

    from tandem.deployments.replicas import DecodeReplica, PrefillReplica

    options = {
        "model": str(tiny_model_dir),
        "kv_cache_memory": 4 << 20,
        "block_size": 4,
        "speculative": None,
        "weight_dtype": "auto",
        "kv_cache_dtype": "auto",
    }
    shared = PROMPTS[0][:28]
    colocated = engine(tiny_model_dir)
    colocated.add_request(GenerationRequest("r", prompt_token_ids=[*shared, 50, 51], sampling_params=PARAMS))
    want = run(colocated)["r"]
    prefill = PrefillReplica(options)
    pool = FlakyPrefillPool(prefill, 0)
    decode = DecodeReplica(pool, options)  # type: ignore[arg-type]

    async def answer(request_id: str, prompt: list[int]) -> list[int]:
        gen = GenerationRequest(request_id, prompt_token_ids=prompt, sampling_params=PARAMS)
        return [t async for out in decode.stream(gen) for t in out.outputs[0].delta_token_ids]

    async def main() -> None:
        await answer("warm", [*shared, 90, 91])
        assert await answer("a", [*shared, 50, 51]) == want
        pool.evict_before_import = decode.engine.engine.kv_manager.pool.reset_prefix_cache
        assert await answer("b", [*shared, 50, 51]) == want

    try:
        asyncio.run(main())
        assert pool.skip_pages == [0, 7, 7, 0]  # cold; cached; cached but evicted, then whole
        wait_for_baseline(decode.engine, prefill.engine)
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()


def test_a_constrained_request_handed_over_continues_its_grammar(tiny_model_dir: Path) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine's matcher
    starts past it: the tokens equal those of one engine, and the text follows the grammar."""
    import re

    from tandem.engine.sampling_params import StructuredOutput

    pattern = r"(quick|lazy|brown) (fox|dog)(, (quick|lazy|brown) (fox|dog))*\."
    params = SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput("regex", pattern))
    gen = GenerationRequest("c", prompt_token_ids=PROMPTS[0], sampling_params=params)
    colocated = engine(tiny_model_dir)
    colocated.add_request(dataclasses.replace(gen))
    want = run(colocated)["c"]

    sender, receiver = engine(tiny_model_dir), engine(tiny_model_dir)
    sender.add_prefill_request(dataclasses.replace(gen))
    run(sender)
    receiver.handover.add_request_with_kv(dataclasses.replace(gen), sender.handover.export_kv("c"))
    got = run(receiver)["c"]
    assert got == want
    assert receiver.grammars is not None and receiver.grammars.matcher(params.structured).accept(got)  # type: ignore[arg-type]
    text = receiver.tokenizer.decode(got)
    if len(got) < 24:  # ended by itself: a whole sentence of the grammar
        assert re.fullmatch(pattern, text), text


def test_the_decode_replica_tokenises_a_chat_request_once(tiny_model_dir: Path) -> None:
    """A chat request handed over (disaggregated) is templated and tokenised once, on the decode
    side; the prefill side and the import read its token ids. The answer equals a colocated
    engine's for the same messages."""
    import asyncio

    from tandem.deployments.replicas import DecodeReplica, PrefillReplica

    options = {"model": str(tiny_model_dir), "kv_cache_memory": 4 << 20, "block_size": 4, "speculative": None,
               "weight_dtype": "auto", "kv_cache_dtype": "auto"}  # fmt: skip
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    colocated = engine(tiny_model_dir)
    colocated.add_request(GenerationRequest("r", messages=messages, sampling_params=PARAMS))
    want = run(colocated)["r"]
    prefill = PrefillReplica(options)
    decode = DecodeReplica(FlakyPrefillPool(prefill, 0), options)  # type: ignore[arg-type]
    calls: list[str] = []
    for side, replica in (("decode", decode), ("prefill", prefill)):
        tokenizer = replica.engine.engine.tokenizer
        for name in ("encode", "apply_chat_template"):
            original = getattr(tokenizer, name)

            def counted(
                *args: Any, _original: Any = original, _tag: str = f"{side}.{name}", **kwargs: Any
            ) -> Any:
                calls.append(_tag)
                return _original(*args, **kwargs)

            setattr(tokenizer, name, counted)

    async def main() -> list[int]:
        gen = GenerationRequest("r", messages=messages, sampling_params=PARAMS)
        return [t async for out in decode.stream(gen) for t in out.outputs[0].delta_token_ids]

    try:
        assert asyncio.run(main()) == want
        assert sorted(calls) == ["decode.apply_chat_template", "decode.encode"]
        wait_for_baseline(decode.engine, prefill.engine)
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()
