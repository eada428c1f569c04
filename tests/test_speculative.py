"""Speculative decoding (prompt lookup): proposals, planning by step cost, exact verification,
and the engine's output unchanged by it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem import GenerationRequest, SamplingParams
from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.llm import LLM
from tandem.engine.request import Request
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import RunnerResult, RunnerStats, SchedulerOutput
from tandem.engine.spec.drafts import (
    AcceptanceTracker,
    DraftCandidate,
    NgramIndex,
    SpeculationSettings,
    StepCostModel,
    plan_drafts,
)
from tandem.kernels.sampling import verify_drafts

from .conftest import make_tiny_model


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # The suffix (7, 2, 3) never occurred before; (2, 3) did, last followed by 4, 5, ...
    assert index.propose(3) == ([4, 5, 7], 2)
    index.extend([4])
    assert index.propose(10) == ([5, 7, 2, 3, 4], 3)  # (2, 3, 4) then runs to the end
    assert NgramIndex(1, 2).propose(3) == ([], 0)
    fresh = NgramIndex(2, 3)
    fresh.extend([5, 6, 7, 8])
    assert fresh.propose(2) == ([], 0)  # no earlier occurrence of any suffix of 2+ tokens


def _reference_proposal(tokens: list[int], min_n: int, max_n: int, num: int) -> tuple[list[int], int]:
    """Prompt lookup by scanning: the longest suffix (max_n down to min_n) that occurred earlier
    with a token after it, and what followed its latest such occurrence."""
    size = len(tokens)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # occurrences ending before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num], n
    return [], 0


def test_ngram_index_built_lazily_proposes_what_a_scan_finds() -> None:
    """Tokens appended in chunks of any size, proposals read at any point (the index catches up
    then): every proposal equals a scan of the whole sequence."""
    rng = random.Random(0)
    for min_n, max_n in ((1, 4), (2, 3), (1, 1)):
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(200):
            chunk = [rng.randrange(6) for _ in range(rng.choice((1, 1, 2, 7, 40)))]
            index.extend(chunk)
            tokens += chunk
            if rng.random() < 0.5:
                num = rng.randrange(1, 6)
                assert index.propose(num) == _reference_proposal(tokens, min_n, max_n, num)


def test_acceptance_is_kept_per_match_length_and_recovers_when_untried() -> None:
    tracker = AcceptanceTracker(max_n=4, initial=0.6, smoothing=0.5, recovery=0.1)
    for _ in range(10):
        tracker.record(4, 5, 5)
        tracker.record(1, 5, 0)
    assert tracker.estimate(4) > 0.9 and tracker.estimate(1) < 0.05 and tracker.estimate(2) == 0.6
    low = tracker.estimate(1)
    for _ in range(30):
        tracker.drift()
    assert low < tracker.estimate(1) < 0.6  # tried again, in time


def test_step_cost_model_separates_fixed_token_and_logits_row_costs() -> None:
    model = StepCostModel(prior_fixed_s=1.0, prior_per_token_s=1.0, prior_per_row_s=1.0)

    def wall(tokens: int, rows: int) -> float:
        return 0.02 + 0.0005 * tokens + 0.001 * rows

    for tokens in range(1, 12):  # decode steps only: tokens == rows, the terms cannot be told apart
        model.observe(tokens, tokens, wall(tokens, tokens))
    assert model.coefficients() == (1.0, 1.0, 1.0)
    for tokens, rows in ((128, 1), (300, 2), (64, 3), (5, 5), (40, 9)):  # prefill chunks, drafts
        model.observe(tokens, rows, wall(tokens, rows))
    fixed, per_token, per_row = model.coefficients()
    assert (fixed, per_token, per_row) == pytest.approx((0.02, 0.0005, 0.001), rel=1e-6)


def test_decode_steps_are_costed_apart_from_prompt_chunks() -> None:
    """A hybrid engine computes prompt chunks eagerly on bfloat16 GEMMs (a larger fixed cost, cheap
    per token) and decode steps on the INT4 native stack (a small fixed cost, each row costs
    more): one fit over both misprices a decode step's draft row; the decode-only fit does not."""
    model = StepCostModel(prior_fixed_s=1.0, prior_per_token_s=1.0, prior_per_row_s=1.0)
    for tokens in (128, 256, 64, 200, 96, 180):  # prompt chunks: 1 row each
        model.observe(tokens, 1, 0.030 + 0.0004 * tokens)
    assert model.decode_coefficients() is None
    for _ in range(3):
        model.observe(1, 1, 0.012)
    assert model.decode_coefficients() is None  # one size only: the per-row cost is unknown
    for rows in (1, 2, 3, 4, 6, 1, 1):  # decode steps, with 0-5 drafts
        model.observe(rows, rows, 0.010 + 0.002 * rows)
    fixed, per_row = model.decode_coefficients() or (0.0, 0.0)
    assert per_row == pytest.approx(0.002, rel=1e-6) and fixed == pytest.approx(0.010, rel=1e-6)
    _, per_token, mixed_per_row = model.coefficients()
    assert abs(per_token + mixed_per_row - per_row) > 0.3 * per_row  # the mixed fit misprices it


def test_plan_drafts_speculates_when_steps_are_fixed_cost_and_stops_as_the_batch_grows() -> None:
    proposal = [1, 2, 3, 4, 5]
    # Batch 1, a step mostly fixed cost (a small model on a CPU): several drafts pay off.
    lone = plan_drafts(
        [DraftCandidate("a", proposal, 0.7)],
        step_cost_s=0.054,
        step_yield=1,
        draft_cost_s=0.004,
        max_draft_tokens=64,
    )
    assert lone["a"] >= 3
    # 32 decoding requests: the step already yields 32 tokens; a draft's expected gain does not
    # pay its cost.
    many = [DraftCandidate(f"r{i}", proposal, 0.7) for i in range(32)]
    assert plan_drafts(many, step_cost_s=0.178, step_yield=32, draft_cost_s=0.004, max_draft_tokens=512) == {}
    # Likelier drafts first; budget and proposal lengths are respected.
    mixed = [DraftCandidate("likely", proposal, 0.9), DraftCandidate("unlikely", [1], 0.1)]
    planned = plan_drafts(mixed, step_cost_s=0.052, step_yield=2, draft_cost_s=0.001, max_draft_tokens=3)
    assert planned == {"likely": 3}


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Drafts proposed deterministically, verified by `verify_drafts`: the first token is
    distributed as p0 and, given it was the draft, the second as p1 (chi-square, 5 tokens)."""
    generator = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.25, 0.25])
    probs = torch.stack([p0, p1, torch.full((5,), 0.2)])
    drafts = [1, 3]
    num = 20000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(num):
        tokens = verify_drafts(probs, drafts, generator)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1

    def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
        expected = counts.sum() * p
        return float(((counts - expected) ** 2 / expected).sum())

    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
    assert chi_square(first, p0) < 18.47, first
    assert chi_square(second, p1) < 18.47, second


def scheduler(num_blocks: int = 16) -> Scheduler:
    sched = Scheduler(
        KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        speculation=SpeculationSettings(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2),
    )
    sched.speculation.always_draft()  # always speculate
    return sched


def test_rejected_drafts_roll_back_and_never_reach_the_prefix_cache() -> None:
    sched = scheduler()
    request = Request("r", [5, 6, 7, 5, 6], SamplingParams(max_tokens=20, temperature=0))
    sched.add_request(request)
    out = sched.schedule()  # prefill: 5 tokens, no drafts yet
    assert [s.draft_token_ids for s in out.scheduled] == [[]]
    sched.update_from_output(out, RunnerResult({"r": [7]}))
    # Tokens 5 6 7 5 6 7: the suffix (6, 7) occurred before, followed by 5, 6, 7.
    out = sched.schedule()
    item = out.scheduled[0]
    assert item.draft_token_ids == [5, 6, 7] and item.token_ids == [7, 5, 6, 7] and item.start_position == 5
    blocks = list(item.block_ids)
    assert len(blocks) == 3  # 9 positions of 4-token blocks: the drafts' slots are allocated
    # The target accepts the first draft (5), then says 9: tokens 5, 9; drafts 6, 7 rejected.
    updates = sched.update_from_output(out, RunnerResult({"r": [5, 9]}))
    assert updates[0].new_token_ids == [5, 9]
    assert request.output_token_ids == [7, 5, 9]
    assert request.num_computed_tokens == 7 == request.num_tokens - 1  # 7 at position 5, 5 at 6
    assert sched.kv.block_table("r").block_ids == blocks  # same blocks; the third is reused next
    # Only the first block (5 6 7 5) is complete with computed tokens: it alone is cached.
    cached = dict(sched.kv.pool.cached)
    assert sorted(cached.values()) == [blocks[0]]
    sched.check_integrity()


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    sched = scheduler()
    sched.add_request(
        Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[2]))
    )
    sched.update_from_output(out := sched.schedule(), RunnerResult({"r": [3]}))
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [1, 2, 3]
    updates = sched.update_from_output(out, RunnerResult({"r": [1, 2, 3, 4]}))  # all accepted
    assert updates[0].finished and updates[0].new_token_ids == [1, 2]
    assert updates[0].request.output_token_ids == [3, 1, 2]
    assert "r" not in sched.kv.tables and sched.kv.pool.num_used_blocks == 0
    sched.check_integrity()


def test_speculation_is_off_for_opted_out_penalised_and_seeded_requests() -> None:
    sched = scheduler()
    for request_id, params in (
        ("off", SamplingParams(max_tokens=20, temperature=0, speculative=False)),
        ("penalised", SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5)),
        ("seeded", SamplingParams(max_tokens=20, temperature=0.8, seed=7)),
        ("on", SamplingParams(max_tokens=20, temperature=0)),
    ):
        sched.add_request(Request(request_id, [1, 2, 1, 2, 1], params))
    out = sched.schedule()
    sched.update_from_output(out, RunnerResult({s.request_id: [2] for s in out.scheduled}))
    drafts = {s.request_id: s.draft_token_ids for s in sched.schedule().scheduled}
    assert drafts["off"] == drafts["penalised"] == drafts["seeded"] == [] and drafts["on"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec"), max_positions=1024)


def test_greedy_output_is_identical_with_speculation_in_mixed_batches_with_preemption(tiny_dir: Path) -> None:
    """Speculating and non-speculating requests in one batch, a KV cache small enough to preempt:
    greedy tokens equal the engine's without speculation, and drafts were really verified."""
    prompts = [[3, 4, 5, 6] * 6 + [7], [9, 10, 11] * 5, [12, 13] * 8 + [14, 15], [20, 21, 22, 23, 24] * 3]
    params = [
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, speculative=False),
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, presence_penalty=0.3),
    ]
    options = {"kv_cache_memory": 96 << 10, "block_size": 4, "enable_prefix_caching": True}
    plain = LLM(str(tiny_dir), **options)
    want = plain.generate(prompts, params)
    spec = LLM(str(tiny_dir), speculative={"method": "ngram", "num_speculative_tokens": 4}, **options)
    spec.engine.scheduler.speculation.always_draft()
    got = spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    for w, g in zip(want[2].outputs[0].logprobs or [], got[2].outputs[0].logprobs or [], strict=True):
        assert set(w) == set(g) and all(abs(w[t] - g[t]) < 1e-4 for t in w)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] > 0, stats
    assert stats["kv_blocks_used"] == 0


def test_greedy_output_is_identical_with_speculation_for_lora_requests(
    tiny_model_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """Prompt lookup needs no draft model, so adapter requests speculate too; drafts are scored
    with the request's adapter, and its tokens are those of decoding without speculation."""
    from tandem import LoRARequest

    prompts = [[3, 4, 5, 6] * 5 + [7], [9, 10, 11] * 5, [12, 13] * 8]
    loras = [
        LoRARequest("all", str(peft_adapters["all-r8"])),
        None,
        LoRARequest("attn", str(peft_adapters["attn-r4"])),
    ]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = {"kv_cache_memory": 8 << 20, "enable_lora": True, "max_lora_rank": 16}
    want = LLM(str(tiny_model_dir), speculative=None, **options).generate(prompts, params, lora=loras)
    spec = LLM(str(tiny_model_dir), **options)
    spec.engine.scheduler.speculation.always_draft()
    got = spec.generate(prompts, params, lora=loras)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.stats()["num_draft_tokens"] > 0


class ScriptedRunner:
    """A fake runner: for each speculating request it accepts the first `accept` drafts and adds
    token 99 of its own; without drafts it returns the next token of `script`. It implements
    what the engine uses of a runner (`step.Runner`) but the KV hand-over."""

    has_draft = False

    def stats(self) -> RunnerStats:
        return RunnerStats()

    def __init__(self, accept: int, script: list[int]) -> None:
        self.accept, self.script = accept, script
        self.num_steps_with_drafts = 0

    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        result = RunnerResult({})
        for item in sched.scheduled:
            if not item.sample:
                continue
            if item.draft_token_ids:
                self.num_steps_with_drafts += 1
                result.sampled_token_ids[item.request_id] = [*item.draft_token_ids[: self.accept], 99]
            else:
                result.sampled_token_ids[item.request_id] = [
                    self.script[len(item.output_token_ids) % len(self.script)]
                ]
        return result


def test_the_engine_runs_on_an_injected_runner(tiny_llm: LLM) -> None:
    """`LLMEngine` takes its runner and tokenizer (`EngineParts`): with a scripted runner the
    engine's own logic (drafts from the prompt, partial acceptance, rollback, lengths, freeing)
    is checked without a model."""
    from tandem.engine.engine import EngineParts, LLMEngine
    from tandem.platform.config import EngineConfig

    real = tiny_llm.engine
    runner = ScriptedRunner(accept=2, script=[5, 6, 7, 8])
    parts = EngineParts(
        model_name="scripted",
        model_config=real.model_config,
        tokenizer=real.tokenizer,
        eos_token_ids=frozenset(),
        runner=runner,
        num_blocks=32,
        max_model_len=256,
        kv_cache_dtype="none",
    )
    engine = LLMEngine(EngineConfig(model="scripted", block_size=4, enable_prefix_caching=False), parts)
    engine.scheduler.speculation.always_draft()
    request = engine.add_request(
        GenerationRequest(
            "r", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], sampling_params=SamplingParams(max_tokens=9)
        )
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1].outputs[0]
    # Step 1 samples 5 (the prompt's end); then drafts from the prompt (6, 7, 8, 9): 6, 7
    # accepted, 99 added; and so on until 9 tokens.
    assert final.token_ids[:4] == [5, 6, 7, 99] and len(final.token_ids) == 9
    assert final.finish_reason == "length" and runner.num_steps_with_drafts >= 2
    assert request.num_computed_tokens == request.num_tokens - 1
    assert engine.stats()["kv_blocks_used"] == 0


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution() -> None:
    """Drafts drawn from q (a draft model), verified against p: the first token is distributed as
    p0 whatever q is (chi-square, 5 tokens)."""
    generator = torch.Generator().manual_seed(1)
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    q0 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])  # a poor draft: most of its mass where p has little
    probs = torch.stack([p0, torch.full((5,), 0.2)])
    counts = torch.zeros(5)
    num = 20000
    for _ in range(num):
        draft = int(torch.multinomial(q0, 1, generator=generator)[0])
        tokens = verify_drafts(probs, [draft], generator, q0.unsqueeze(0))
        counts[tokens[0]] += 1
    expected = num * p0
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.47, counts


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["self-draft", "other-draft"])
def test_greedy_output_is_identical_with_a_draft_model(
    tiny_dir: Path, tmp_path: Path, draft_seed: int
) -> None:
    """A draft model with its own KV beside the target's, in mixed batches with preemption: greedy
    tokens equal the target's alone. The target as its own draft (seed 0) has every draft accepted;
    another random model (seed 1) has most rejected, so rollback is exercised too."""
    draft_dir = (
        tiny_dir
        if draft_seed == 0
        else make_tiny_model(tmp_path / "draft", seed=draft_seed, max_positions=1024)
    )
    prompts = [[3, 4, 5, 6] * 6 + [7], [9, 10, 11] * 5, [12, 13] * 8 + [14, 15], [20, 21, 22, 23, 24] * 3]
    params = [
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, speculative=False),
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
    ]
    options = {"kv_cache_memory": 160 << 10, "block_size": 4}
    want = LLM(str(tiny_dir), speculative=None, **options).generate(prompts, params)
    # A sampled request rides along (rejection sampling against the draft's distribution).
    prompts, params = (
        [*prompts, [30, 31, 32] * 4],
        [*params, SamplingParams(max_tokens=50, temperature=0.9, ignore_eos=True)],
    )
    spec = LLM(
        str(tiny_dir),
        speculative={"method": "draft", "draft_model": str(draft_dir), "num_speculative_tokens": 3},
        **options,
    )
    spec.engine.scheduler.speculation.always_draft()
    got = spec.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got[:4]] == [w.outputs[0].token_ids for w in want]
    assert len(got[4].outputs[0].token_ids) == 50 and got[4].outputs[0].finish_reason == "length"
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["num_draft_tokens"] > 0, stats
    assert 0 < stats["draft_wall_s"] < stats["step_wall_s"]
    if draft_seed == 0:
        assert stats["draft_acceptance_rate"] > 0.95, stats
    else:
        assert stats["draft_acceptance_rate"] < 0.9, stats
    assert stats["kv_blocks_used"] == 0


def test_a_draft_model_must_share_the_vocabulary(tiny_dir: Path) -> None:
    from tandem.platform.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="vocabulary") as info:
        LLM(str(tiny_dir), speculative={"method": "draft", "draft_model": "smollm2-135m-instruct"})
    assert info.value.param == "speculative.draft_model"


def test_acceptance_is_the_conditional_rate_the_planner_models() -> None:
    """Five drafts of which the first two are accepted, again and again: each reached draft is
    accepted with probability 2/3 (the third was reached and rejected, the last two never
    reached), not 2/5."""
    tracker = AcceptanceTracker(max_n=2, initial=0.5, smoothing=0.2, recovery=0.0)
    for _ in range(100):
        tracker.record(2, 5, 2)
    assert tracker.estimate(2) == pytest.approx(2 / 3, abs=1e-3)


def test_a_draft_row_is_charged_the_jump_of_a_step_that_verifies() -> None:
    """At 32 decoding requests a CPU step of one row each ran 32.6 ms and with a few drafts 48-76 ms
    (its rows then take other kernels): what a draft costs is the secant from the step's own size,
    not the slope of a fit dominated by far sizes."""
    model = StepCostModel()
    for _ in range(40):
        model.observe(32, 32, 0.0326)
    for rows, wall in ((38, 0.0479), (40, 0.0489), (56, 0.0577), (56, 0.0577), (70, 0.0770)):
        model.observe(rows, rows, wall)
    wall, per_row = model.decode_step_costs(32) or (0.0, 0.0)
    assert wall == pytest.approx(0.0326)
    # the sizes that carried drafts alone rise 0.9 ms a row (38 to 70 rows): the first drafts cost more
    assert per_row > 0.0012
    # so 32 requests draft nothing even at 0.9 acceptance; one request still does
    many = [DraftCandidate(f"r{i}", [1, 2, 3], 0.9) for i in range(32)]
    assert plan_drafts(many, step_cost_s=wall, step_yield=32, draft_cost_s=per_row, max_draft_tokens=64) == {}
    for rows, wall_1 in ((1, 0.0060), (2, 0.0095), (3, 0.0128), (4, 0.0149)):
        model.observe(rows, rows, wall_1)
    wall, per_row = model.decode_step_costs(1) or (0.0, 0.0)
    lone = plan_drafts(
        [DraftCandidate("a", [1, 2, 3], 0.9)],
        step_cost_s=wall,
        step_yield=1,
        draft_cost_s=per_row,
        max_draft_tokens=8,
    )
    assert lone.get("a", 0) >= 1
