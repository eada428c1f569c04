"""Parallel sampling (n > 1) in the engine: choices equal separate requests with the per-choice
seeds, and the prompt is computed once (its full blocks shared by every choice)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem import LLM, AsyncEngine, GenerationRequest, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import MAX_SEED, MIN_SEED
from tandem.engine.sched.parallel_sampling import choice_seed
from tandem.platform.errors import InvalidRequestError

# 70 tokens or so: four full blocks of 16 and a partial one
PROMPT = " ".join(["paged attention stores keys and values in blocks"] * 8)


def sampled(seed: int | None, n: int = 1, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def test_choices_equal_separate_requests_with_the_choice_seeds(tiny_llm: LLM) -> None:
    out = tiny_llm.generate([PROMPT], sampled(seed=7, n=4))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    separate = [tiny_llm.generate([PROMPT], sampled(seed=7 + i))[0].outputs[0] for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in separate]
    assert [c.text for c in out.outputs] == [s.text for s in separate]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # sampled: the choices differ
    again = tiny_llm.generate([PROMPT], sampled(seed=7, n=4))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_greedy_choices_are_identical(tiny_llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True)
    out = tiny_llm.generate([PROMPT], params)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_choice_seeds_wrap_into_the_seed_range() -> None:
    assert choice_seed(5, 3) == 8 and choice_seed(None, 2) is None
    assert choice_seed(MAX_SEED, 1) == MIN_SEED


def test_n_is_validated() -> None:
    for bad in (0, 129, 2.0, True):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(n=bad)
        assert err.value.param == "n"


def test_the_prompt_is_computed_once_and_its_blocks_shared(tiny_model_dir: Path) -> None:
    """Block counts: the choices hold the prompt's full blocks once between them, and the engine
    computes the prompt's tokens once plus each other choice's last partial block."""
    engine = LLMEngine.from_options(
        str(tiny_model_dir), kv_cache_memory=4 << 20, enable_prefix_caching=False, max_num_batched_tokens=512
    )
    block_size = engine.kv_manager.block_size
    n = 4
    engine.add_request(
        GenerationRequest("fam", prompt=PROMPT, sampling_params=sampled(seed=1, n=n, max_tokens=6))
    )
    prompt_len = len(engine.scheduler.requests["fam#0"].prompt_token_ids)
    num_full = (prompt_len - 1) // block_size
    assert num_full >= 2
    shared_seen = False
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        tables = {rid: t.block_ids for rid, t in engine.kv_manager.tables.items()}
        if len(tables) == n:
            heads = {tuple(t[:num_full]) for t in tables.values()}
            if len(heads) == 1:  # every choice holds the same full prompt blocks
                shared_seen = True
                used = engine.kv_manager.pool.num_used_blocks
                per_choice = -(-(prompt_len + 1) // block_size) - num_full  # its own tail blocks
                assert used <= num_full + n * (per_choice + 1)
                assert all(engine.kv_manager.pool.ref_counts[b] == n for b in next(iter(heads)))
        engine.kv_manager.check_integrity()
    assert shared_seen
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and [c.index for c in final[0].outputs] == list(range(n))
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_prompt_tokens_computed_once(tiny_model_dir: Path) -> None:
    """The scheduler computes the prompt once: scheduled tokens over the run are one prompt plus,
    per other choice, at most a block of its prompt, plus the generated tokens."""
    engine = LLMEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20, enable_prefix_caching=False)
    n, max_tokens = 4, 5
    engine.add_request(
        GenerationRequest("fam", prompt=PROMPT, sampling_params=sampled(seed=3, n=n, max_tokens=max_tokens))
    )
    prompt_len = len(engine.scheduler.requests["fam#0"].prompt_token_ids)
    num_tokens = 0
    real_schedule = engine.scheduler.schedule

    def counting_schedule():  # type: ignore[no-untyped-def]
        nonlocal num_tokens
        output = real_schedule()
        num_tokens += output.num_scheduled_tokens
        return output

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()
    block_size = engine.kv_manager.block_size
    tail = prompt_len - (prompt_len - 1) // block_size * block_size  # each other choice recomputes these
    assert num_tokens == prompt_len + (n - 1) * tail + n * (max_tokens - 1)
    assert num_tokens < n * prompt_len


def test_async_engine_streams_choices_with_their_index_and_abort_ends_all(tiny_model_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20)
        try:
            indexes: set[int] = set()
            text: dict[int, str] = {}
            last = None
            async for out in engine.generate(
                GenerationRequest("s", prompt=PROMPT, sampling_params=sampled(5, n=3))
            ):
                for c in out.outputs:
                    indexes.add(c.index)
                    text[c.index] = text.get(c.index, "") + c.delta_text
                last = out
            assert last is not None and last.finished and indexes == {0, 1, 2}
            assert [text[i] for i in range(3)] == [c.text for c in last.outputs]
            # leaving early aborts every choice and frees their blocks
            stream = engine.generate(
                GenerationRequest("a", prompt=PROMPT, sampling_params=sampled(5, n=3, max_tokens=200))
            )
            await anext(stream)
            await stream.aclose()  # what a client disconnect does: aborts every choice
            # Any request that completes afterwards ran after the abort was applied.
            async for _ in engine.generate(
                GenerationRequest("b", prompt="Hello", sampling_params=sampled(1))
            ):
                pass
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
