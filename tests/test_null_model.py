"""The null model (`EngineConfig.null_model_step_ms`): the platform's own work without a model, as
`benchmarks/platform_overhead.py` measures it."""

from __future__ import annotations

import gc
import time

from tandem.engine.engine import LLMEngine
from tandem.engine.protocol import GenerationRequest
from tandem.engine.runner.null_runner import NullRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.platform.config import EngineConfig


def test_a_null_engine_streams_the_fixed_token_cycle_for_every_request() -> None:
    engine = LLMEngine.from_config(EngineConfig(null_model_step_ms=0.0, max_num_seqs=8, max_model_len=64))
    runner = engine.runner
    assert isinstance(runner, NullRunner) and len(runner.token_ids) >= 8
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(
            GenerationRequest(f"r{i}", prompt="Hello there", sampling_params=params), stream_text=True
        )
    finals, deltas = {}, {f"r{i}": "" for i in range(8)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id] += out.outputs[0].delta_text
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    expected_ids = [runner.token_ids[k % len(runner.token_ids)] for k in range(12)]
    assert len(finals) == 8
    for request_id, final in finals.items():
        assert final.token_ids == expected_ids and final.finish_reason == "length"
        # ordinary words, each its own text: the streamed deltas add up to the final text
        assert final.text == engine.tokenizer.decode(expected_ids) == deltas[request_id]
        assert len(final.text.split()) == 12
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_null_runner_step_waits_its_time() -> None:
    engine = LLMEngine.from_config(EngineConfig(null_model_step_ms=20.0, max_model_len=64))
    engine.add_request(
        GenerationRequest(
            "r", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True)
        )
    )
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    assert time.perf_counter() - started >= 3 * 0.020


def test_settle_heap_leaves_a_process_outside_an_actor_alone() -> None:
    from tandem.deployments.replicas import settle_heap

    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    settle_heap()
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen
