"""Scheduling ahead on the model runner (`ModelRunner.overlappable`: on by itself on CUDA, forced on
this CPU here): each step is scheduled while the previous one runs on the device thread, and every
request ends with the serial engine's tokens, text, logprobs and finish reason: greedy, seeded
sampling, penalties (which read the output so far, never the placeholder of the step in flight),
a grammar constraint, a stop string found after the next step was sent, a prompt over several
chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engine.builder import build_parts
from tandem.engine.engine import LLMEngine
from tandem.engine.protocol import CompletionOutput, GenerationRequest
from tandem.engine.sampling_params import SamplingParams, StructuredOutput
from tandem.platform.config import EngineConfig

# Which requests each variant leaves out: a step with the constrained one ("regex") is not chained
LEFT_OUT = {"mixed": (), "penalised": ("regex",), "plain": ("regex", "penalised", "repetition")}


def _requests(stop: str, variant: str = "mixed") -> dict[str, SamplingParams]:
    requests = {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        # penalties over the output so far (negative: seen tokens come back, so the tokens depend
        # on every one before), and the repetition penalty over the prompt and output
        "penalised": SamplingParams(
            max_tokens=24, temperature=0.0, frequency_penalty=-0.3, presence_penalty=-0.3, ignore_eos=True
        ),
        "repetition": SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        "logprobs": SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
        "regex": SamplingParams(
            max_tokens=30,
            temperature=0.0,
            structured=StructuredOutput("regex", "[a-z]{3,12}( [a-z]{2,9}){2,5}"),
        ),
        "stop": SamplingParams(max_tokens=40, temperature=0.0, stop=[stop] if stop else [], ignore_eos=True),
        "long-prompt": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    }
    return {k: v for k, v in requests.items() if k not in LEFT_OUT[variant]}


def _run(
    model: Path, ahead: bool, stop: str = "", variant: str = "mixed"
) -> tuple[dict[str, CompletionOutput], LLMEngine]:
    config = EngineConfig(
        model=str(model), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, max_num_batched_tokens=64,
        block_size=4, async_scheduling=ahead, speculative=None,
    )  # fmt: skip
    parts = build_parts(config)
    parts.runner.overlappable = ahead  # type: ignore[attr-defined]
    engine = LLMEngine(config, parts)
    assert (engine.pipeline is not None) is ahead
    for i, (request_id, params) in enumerate(_requests(stop, variant).items()):
        words = 20 if request_id == "long-prompt" else 2 + i
        prompt = " ".join(["paged attention batches requests"] * words)
        engine.add_request(
            GenerationRequest(request_id, prompt=prompt, sampling_params=params), stream_text=True
        )
    finals: dict[str, CompletionOutput] = {}
    streamed: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].delta_text
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        engine.scheduler.check_integrity()
    assert all(streamed[request_id] == final.text for request_id, final in finals.items())
    return finals, engine


@pytest.mark.parametrize("variant", list(LEFT_OUT))
def test_the_model_runner_scheduled_ahead_gives_the_serial_engines_outputs(
    tiny_model_dir: Path, variant: str
) -> None:
    """Without a constrained request ("plain", "penalised") the steps are chained: each queued on
    the device behind the one before, whose tokens the device thread puts in place (a penalised
    request's output so far too); "mixed": the steps with a constrained request are not."""
    unstopped, _ = _run(tiny_model_dir, ahead=False, variant=variant)
    text = unstopped["stop"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # found about half-way: the next step is in flight
    assert stop.strip(), text
    serial, _ = _run(tiny_model_dir, ahead=False, stop=stop, variant=variant)
    ahead, engine = _run(tiny_model_dir, ahead=True, stop=stop, variant=variant)
    pipeline = engine.pipeline
    assert pipeline is not None and pipeline.num_steps_ahead > 10
    if "regex" in serial:  # the steps while it runs are not chained (12 of 26 steps are here)
        assert 0 < pipeline.num_steps_chained < pipeline.num_steps_ahead, vars(pipeline)
    else:
        assert pipeline.num_steps_chained >= pipeline.num_steps_ahead / 2, vars(pipeline)  # all but one here
    if "penalised" in serial:
        for penalised in ("penalised", "repetition"):
            assert serial[penalised].token_ids != serial["greedy"].token_ids, penalised
    assert serial["stop"].finish_reason == "stop" and serial["stop"].stop_reason == stop
    for request_id, expected in serial.items():
        got = ahead[request_id]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason, got.logprobs) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
            expected.stop_reason,
            expected.logprobs,
        ), request_id
    assert engine.stats()["kv_blocks_used"] == 0
