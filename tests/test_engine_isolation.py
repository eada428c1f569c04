"""Isolation inside the engine: a request that breaks its step fails alone, an unattributable
failure breaks the engine (every stream ends with an error), and the prefix cache never serves one
tenant's or one adapter's KV to another (checked where the engine applies it, against PEFT)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from tandem import LLM, AsyncEngine, LoRARequest, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.platform.errors import RequestFailedError, ServiceUnavailableError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Request {i}: continuous batching shares one forward pass" for i in range(3)]


def run_all(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
    """Add every request, step until all finish; the final output of each."""
    for request in requests:
        engine.add_request(request)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def bad_seed_params() -> SamplingParams:
    """Sampling parameters that passed validation, then were changed to a seed the generator
    refuses (as a bug or a new client path might): sampling raises for that row only."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    params.seed = 1 << 64
    return params


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path, peft_adapters: dict[str, Path]) -> LLM:
    # A small KV pool (block_size 4): blocks freed by a failed request are soon handed to others.
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_memory=128 << 10,
        block_size=4,
        enable_lora=True,
        max_loras=3,
        max_num_seqs=8,
    )
    llm.engine.adapters.add("good", str(peft_adapters["all-r8"]))
    return llm


def inject_adapter(llm: LLM, name: str, scale_b: float, fill_a: float | None = None) -> None:
    """Register a copy of the valid adapter with B scaled (or A filled), bypassing validation, as a
    bug in a loader or a corrupt cache could."""
    engine = llm.engine
    assert engine.adapters.manager is not None
    good = engine.adapters.manager.adapters["good"]
    weights = {}
    for key, (a, b) in good.weights.items():
        a = a.clone() if fill_a is None else torch.full_like(a, fill_a)
        weights[key] = (a, b * scale_b)
    engine.adapters.manager.add(dataclasses.replace(good, name=name, weights=weights))


@pytest.mark.parametrize("fault", ["bad_seed", "nan_adapter", "overflowing_adapter"])
def test_a_request_that_breaks_its_step_fails_alone(lora_llm: LLM, fault: str) -> None:
    """Two base-model requests and one with a valid adapter run next to the faulty one: the faulty
    one ends with finish_reason 'error', the others produce exactly their clean-run tokens, and the
    requests that reuse the KV blocks it left behind are unaffected too."""
    engine = lora_llm.engine
    if fault == "nan_adapter":
        inject_adapter(lora_llm, "nan", 1.0, fill_a=float("nan"))
    elif fault == "overflowing_adapter":
        inject_adapter(lora_llm, "huge", 1e38)  # finite weights, infinite activations
    loras = [None, "good", None]
    clean = run_all(
        engine,
        [
            GenerationRequest(f"clean-{fault}-{i}", prompt=p, sampling_params=GREEDY, lora_name=lora)
            for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))
        ],
    )
    bad = GenerationRequest(
        f"bad-{fault}",
        prompt="The hostile request shares the step " * 3,
        sampling_params=bad_seed_params() if fault == "bad_seed" else GREEDY,
        lora_name={"bad_seed": None, "nan_adapter": "nan", "overflowing_adapter": "huge"}[fault],
    )
    failed_before = engine.num_failed_requests
    mixed = run_all(
        engine,
        [bad]
        + [
            GenerationRequest(f"mixed-{fault}-{i}", prompt=p, sampling_params=GREEDY, lora_name=lora)
            for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))
        ],
    )
    victim = mixed[bad.request_id]
    assert victim.outputs[0].finish_reason == "error" and victim.error_code == "request_failed"
    assert victim.error and "Traceback" not in victim.error
    assert engine.num_failed_requests == failed_before + 1
    for i in range(len(PROMPTS)):
        assert (
            mixed[f"mixed-{fault}-{i}"].outputs[0].token_ids
            == clean[f"clean-{fault}-{i}"].outputs[0].token_ids
        )
    # The blocks the faulty request held are free again, and the next requests (many blocks, so
    # they take those) answer exactly as before.
    again = run_all(
        engine,
        [
            GenerationRequest(f"after-{fault}-{i}", prompt=p * 2, sampling_params=GREEDY, lora_name=lora)
            for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))
        ],
    )
    reference = run_all(
        engine,
        [
            GenerationRequest(f"ref-{fault}-{i}", prompt=p * 2, sampling_params=GREEDY, lora_name=lora)
            for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))
        ],
    )
    for i in range(len(PROMPTS)):
        assert (
            again[f"after-{fault}-{i}"].outputs[0].token_ids
            == reference[f"ref-{fault}-{i}"].outputs[0].token_ids
        )
    assert engine.num_consecutive_failed_steps == 0
    engine.scheduler.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0 or engine.config.enable_prefix_caching


def test_non_finite_kv_never_reaches_the_cache(lora_llm: LLM) -> None:
    """A NaN adapter's rows are written to the KV cache as finite values: other requests read
    those slots as padding (probability 0), and 0 * NaN would be NaN."""
    inject_adapter(lora_llm, "nan-kv", 1.0, fill_a=float("nan"))
    engine = lora_llm.engine
    run_all(
        engine,
        [GenerationRequest("nan-kv", prompt=PROMPTS[0] * 3, sampling_params=GREEDY, lora_name="nan-kv")],
    )
    for k_cache, v_cache, _, _ in engine.runner.kv_caches:
        assert bool(torch.isfinite(k_cache).all()) and bool(torch.isfinite(v_cache).all())


def test_a_broken_runner_fails_every_stream_and_reports_unhealthy(tiny_model_dir: Path) -> None:
    """A model pass that raises for every request of a step, each rerun alone, is the runner, not a
    request: the engine breaks, every stream in flight ends with an `engine_failed` error (none
    hangs), `is_alive` turns False (so the replica's health check fails and Serve replaces it) and
    new requests get a 503. The streams were mid-generation when it broke."""
    engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    def broken_forward(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("device lost")

    async def scenario() -> list[tuple[int, BaseException | str]]:
        started = asyncio.Event()
        num_started = 0

        async def one(i: int) -> tuple[int, BaseException | str]:
            nonlocal num_started
            request = GenerationRequest(f"r{i}", prompt=PROMPTS[i], sampling_params=long)
            num_tokens = 0
            try:
                async for out in engine.generate(request):
                    num_tokens += len(out.outputs[0].delta_token_ids)
                    if num_tokens == 1:
                        num_started += 1
                        if num_started == len(PROMPTS):
                            started.set()
                    if out.finished:
                        return num_tokens, out.outputs[0].finish_reason or ""
            except (RequestFailedError, ServiceUnavailableError) as exc:
                return num_tokens, exc
            return num_tokens, "no final output"

        async def break_runner() -> None:
            await started.wait()  # every stream has its first token: they are in flight
            engine.engine.runner.model.forward = broken_forward  # type: ignore[method-assign]
            engine.engine.runner.decode_model.forward = broken_forward  # type: ignore[method-assign]

        results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), break_runner())
        return [r for r in results if r is not None]

    try:
        assert engine.is_alive()
        results = asyncio.run(scenario())
        assert not engine.is_alive()
        for num_tokens, outcome in results:
            assert 1 <= num_tokens < 400, results  # broken mid-stream, not at the end
            assert isinstance(outcome, RequestFailedError) and outcome.code == "engine_failed", results
            assert outcome.status_code == 500 and "Traceback" not in outcome.message

        async def late() -> None:
            async for _ in engine.generate(GenerationRequest("late", prompt="x", sampling_params=GREEDY)):
                pass

        with pytest.raises(ServiceUnavailableError):
            asyncio.run(late())
    finally:
        engine.shutdown()


def test_one_request_that_breaks_the_model_pass_fails_alone(lora_llm: LLM) -> None:
    """A model pass that raises for one request (here: its adapter's slot tensors are the wrong
    shape) is rerun request by request: that request fails, the others in the step go on, and the
    engine stays healthy."""
    engine = lora_llm.engine
    inject_adapter(lora_llm, "misshapen", 1.0)
    assert engine.adapters.manager is not None
    misshapen = engine.adapters.manager.adapters["misshapen"]
    key = next(iter(misshapen.weights))
    a, b = misshapen.weights[key]
    misshapen.weights[key] = (a, b.flatten())  # B no longer fits the slot: loading it raises
    clean = run_all(
        engine, [GenerationRequest(f"c{i}", prompt=p, sampling_params=GREEDY) for i, p in enumerate(PROMPTS)]
    )
    mixed = run_all(
        engine,
        [GenerationRequest("misshapen", prompt=PROMPTS[0], sampling_params=GREEDY, lora_name="misshapen")]
        + [GenerationRequest(f"m{i}", prompt=p, sampling_params=GREEDY) for i, p in enumerate(PROMPTS)],
    )
    assert mixed["misshapen"].outputs[0].finish_reason == "error"
    for i in range(len(PROMPTS)):
        assert mixed[f"m{i}"].outputs[0].token_ids == clean[f"c{i}"].outputs[0].token_ids
    assert engine.num_consecutive_failed_steps == 0


LONG_PROMPT = "Paged attention stores keys and values in fixed-size blocks. " * 6


def test_prefix_cache_is_per_tenant_unless_shared(tiny_model_dir: Path) -> None:
    """The same long prompt as two tenants: the second finds nothing cached; with
    `share_prefix_cache_across_tenants` it hits."""
    for shared in (False, True):
        llm = LLM(
            str(tiny_model_dir),
            kv_cache_memory=4 << 20,
            block_size=8,
            share_prefix_cache_across_tenants=shared,
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        first = run_all(
            llm.engine, [GenerationRequest("a", prompt=LONG_PROMPT, sampling_params=params, tenant_id="acme")]
        )
        again = run_all(
            llm.engine,
            [GenerationRequest("a2", prompt=LONG_PROMPT, sampling_params=params, tenant_id="acme")],
        )
        other = run_all(
            llm.engine,
            [GenerationRequest("b", prompt=LONG_PROMPT, sampling_params=params, tenant_id="globex")],
        )
        assert first["a"].metrics.num_cached_tokens == 0
        assert again["a2"].metrics.num_cached_tokens >= 32  # the same tenant hits
        if shared:
            assert other["b"].metrics.num_cached_tokens >= 32
        else:
            assert other["b"].metrics.num_cached_tokens == 0
        assert other["b"].outputs[0].token_ids == first["a"].outputs[0].token_ids


def test_prefix_cache_never_serves_base_kv_to_an_adapter(
    tiny_model_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """The same long prompt (several blocks) on the base model, then with an adapter: the adapter
    run finds no cached tokens and answers as PEFT does; a second adapter run hits its own cache."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    llm = LLM(str(tiny_model_dir), kv_cache_memory=8 << 20, block_size=8, enable_lora=True)
    adapter = LoRARequest("attn", str(peft_adapters["attn-r4"]))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = llm.generate([LONG_PROMPT], params)[0]
    tuned = llm.generate([LONG_PROMPT], params, lora=adapter)[0]
    tuned_again = llm.generate([LONG_PROMPT], params, lora=adapter)[0]
    assert len(base.prompt_token_ids) >= 32
    assert tuned.metrics.num_cached_tokens == 0
    assert tuned_again.metrics.num_cached_tokens >= 32
    model = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
        str(peft_adapters["attn-r4"]),
    ).eval()
    ids = torch.tensor([base.prompt_token_ids])
    with torch.no_grad():
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.shape[1] :].tolist()
    assert tuned.outputs[0].token_ids == want
    assert tuned_again.outputs[0].token_ids == want
    assert base.outputs[0].token_ids != want  # the adapter really changes the answer
