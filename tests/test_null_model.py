"""The null model (`EngineConfig.null_model_step_ms`): the platform's own work without a model, as
`benchmarks/platform_overhead.py` measures it."""

from __future__ import annotations

import gc
import time

from tandem.engine.engine import LLMEngine
from tandem.engine.null_setup import build_null_parts
from tandem.engine.protocol import CompletionOutput, GenerationRequest
from tandem.engine.runner.null_runner import NullRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched.step import PLACEHOLDER_TOKEN, RunnerResult, SchedulerOutput
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
    assert len(finals) == 8
    for request_id, final in finals.items():
        num_prompt = len(engine.tokenizer.encode("Hello there"))
        expected_ids = [runner.token_ids[(num_prompt + k) % len(runner.token_ids)] for k in range(12)]
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


class ScriptedDevice(NullRunner):
    """A device runner whose token at position p of request r is a function of (r, p) only; request
    ids starting with "eos" sample an end-of-sequence token at position 40. It refuses a step that
    would write past the context (`max_model_len`) or holds a placeholder for a token."""

    def __init__(
        self, token_ids: list[int], eos_token_id: int, step_s: float, overlappable: bool, max_model_len: int
    ) -> None:
        super().__init__(token_ids, step_s)
        self.eos_token_id = eos_token_id
        self._overlappable = overlappable
        self.max_model_len = max_model_len
        self.num_sampled: dict[str, int] = {}  # rows sampled per request

    @property
    def overlappable(self) -> bool:
        return self._overlappable

    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        result = super().execute(sched)
        for item in sched.scheduled:
            assert item.start_position + len(item.token_ids) <= self.max_model_len, item
            assert PLACEHOLDER_TOKEN not in item.token_ids, item
            if item.sample:
                self.num_sampled[item.request_id] = self.num_sampled.get(item.request_id, 0) + 1
                position = (
                    item.start_position + len(item.token_ids) - len(item.draft_token_ids)
                )  # drafts: rejected
                offset = sum(map(ord, item.request_id))
                token = self.token_ids[(position * 7 + offset) % len(self.token_ids)]
                result.sampled_token_ids[item.request_id] = [
                    self.eos_token_id if item.request_id.startswith("eos") and position == 40 else token
                ]
        return result


def _run_scripted(
    ahead: bool, num_blocks: int | None = None
) -> tuple[dict[str, CompletionOutput], LLMEngine]:
    config = EngineConfig(
        null_model_step_ms=0.0, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
        block_size=4, async_scheduling=ahead,
    )  # fmt: skip
    parts = build_null_parts(config)
    assert isinstance(parts.runner, NullRunner)
    eos = min(parts.eos_token_ids)
    parts.runner = ScriptedDevice(parts.runner.token_ids, eos, 0.001, overlappable=ahead, max_model_len=128)
    if num_blocks is not None:
        parts.num_blocks = num_blocks
    engine = LLMEngine(config, parts)
    assert (engine.pipeline is not None) is ahead
    first_word = engine.tokenizer.decode(parts.runner.token_ids[:1]).strip()
    requests = {
        "plain": SamplingParams(max_tokens=30, ignore_eos=True),
        "short": SamplingParams(max_tokens=3, ignore_eos=True),
        "eos-a": SamplingParams(max_tokens=60),
        "stop-string": SamplingParams(max_tokens=60, stop=[first_word]),
        "abort-me": SamplingParams(max_tokens=60, ignore_eos=True),
        "long-prompt": SamplingParams(max_tokens=20, ignore_eos=True),
    }
    if num_blocks is None:  # a request that runs to the end of the context (32 blocks)
        requests["to-the-context"] = SamplingParams(max_tokens=None, ignore_eos=True)
    for i, (request_id, params) in enumerate(requests.items()):
        prompt = list(range(300 + i, 300 + i + (90 if request_id == "long-prompt" else 7 + i)))
        engine.add_request(
            GenerationRequest(request_id, prompt_token_ids=prompt, sampling_params=params), stream_text=True
        )
    finals: dict[str, CompletionOutput] = {}
    streamed: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].delta_token_ids
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        engine.scheduler.check_integrity()
        if len(streamed["abort-me"]) >= 5 and "abort-me" not in finals:
            aborted = engine.abort_request("abort-me")
            assert aborted is not None
            finals["abort-me"] = aborted.outputs[0]
    for request_id, final in finals.items():
        assert streamed[request_id] == final.token_ids or request_id == "abort-me", request_id
    assert len(finals) == len(requests)
    return finals, engine


def test_scheduling_ahead_gives_the_serial_engines_outputs() -> None:
    """Each step scheduled while the previous one runs (placeholders, then the real tokens): every
    request ends with the tokens, text and finish reason of the serial engine: length, EOS, a stop
    string found after the next step was sent, an abort, a prompt over several chunks."""
    serial, _ = _run_scripted(ahead=False)
    ahead, engine = _run_scripted(ahead=True)
    assert engine.pipeline is not None and engine.pipeline.num_steps_ahead > 20
    assert engine.pipeline.num_steps_chained > 10  # queued behind the running step (its 1 ms)
    for request_id, expected in serial.items():
        got = ahead[request_id]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
            expected.stop_reason,
        ), request_id
    assert serial["eos-a"].finish_reason == "stop" and serial["stop-string"].stop_reason is not None
    # a request that its length limit ends is never computed past it (a step chained behind its
    # last token leaves it out)
    assert isinstance(engine.runner, ScriptedDevice)
    for request_id, final in ahead.items():
        if final.finish_reason == "length":
            assert engine.runner.num_sampled[request_id] == len(final.token_ids), request_id
    assert serial["abort-me"].finish_reason == "abort" and len(serial["abort-me"].token_ids) == 5
    assert engine.stats()["kv_blocks_used"] == 0


def test_scheduling_ahead_waits_for_results_where_blocks_are_short() -> None:
    """With too few free blocks to rule out a preemption the running step is settled before the
    next is scheduled: the same outputs, preemptions included."""
    serial, serial_engine = _run_scripted(ahead=False, num_blocks=30)
    ahead, engine = _run_scripted(ahead=True, num_blocks=30)
    for request_id, expected in serial.items():
        assert ahead[request_id].token_ids == expected.token_ids, request_id
    stats = engine.stats()
    assert stats["num_preemptions"] == serial_engine.stats()["num_preemptions"] > 0
    assert 0 < stats["num_steps_scheduled_ahead"] < stats["num_steps"]  # some steps waited, some not
