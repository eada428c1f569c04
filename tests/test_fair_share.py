"""Fair shares between tenants in the scheduler: exact seats, token budgets over steps and
preemption victims, for two and three tenants, equal and weighted 2:1."""

from __future__ import annotations

from collections import Counter

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched.fair_share import FairShare
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import RunnerResult, SchedulerOutput


def make_scheduler(
    *, max_seqs: int = 6, budget: int = 64, num_blocks: int = 128, weights: dict[str, float] | None = None
) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, watermark=0.0)
    return Scheduler(
        kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512,
        fair_share=FairShare(weights),
    )  # fmt: skip


ARRIVALS = iter(range(1_000_000))


def add(
    sched: Scheduler, tenant: str, count: int = 1, num_prompt: int = 4, max_tokens: int = 100
) -> list[str]:
    ids = []
    for _ in range(count):
        arrival = next(ARRIVALS)
        rid = f"{tenant}{arrival}"
        sched.add_request(
            Request(
                rid,
                list(range(1, num_prompt + 1)),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                tenant_id=tenant,
                arrival_time=float(arrival),
            )  # fmt: skip
        )
        ids.append(rid)
    return ids


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, RunnerResult({s.request_id: [7] for s in out.scheduled if s.sample}))
    sched.check_integrity()
    return out


def seats(sched: Scheduler) -> dict[str, int]:
    return dict(Counter(r.tenant_id or "" for r in sched.running))


def test_a_newcomer_takes_seats_from_the_tenant_over_its_share() -> None:
    sched = make_scheduler(max_seqs=6)
    a = add(sched, "a", 6)
    step(sched)
    assert seats(sched) == {"a": 6}
    add(sched, "b", 3)
    out = step(sched)
    assert out.preempted_request_ids == [a[5], a[4], a[3]]  # a's latest arrivals
    assert seats(sched) == {"a": 3, "b": 3}
    for _ in range(5):  # stable: no seat changes hands again
        assert not step(sched).preempted_request_ids
        assert seats(sched) == {"a": 3, "b": 3}


def test_seats_follow_weights_two_to_one() -> None:
    sched = make_scheduler(max_seqs=6, weights={"a": 2.0})
    add(sched, "a", 8)
    step(sched)
    add(sched, "b", 8)
    step(sched)
    assert seats(sched) == {"a": 4, "b": 2}
    step(sched)
    assert seats(sched) == {"a": 4, "b": 2}


def test_three_tenants_share_seats_equally() -> None:
    sched = make_scheduler(max_seqs=6)
    add(sched, "a", 6)
    step(sched)
    add(sched, "b", 6)
    add(sched, "c", 6)
    step(sched)
    assert seats(sched) == {"a": 2, "b": 2, "c": 2}


def prompt_owners(sched: Scheduler, num_steps: int) -> str:
    """Whose prompt chunk each step computes (the budget is one chunk)."""
    owners = ""
    for _ in range(num_steps):
        out = step(sched)
        assert len(out.scheduled) == 1 and out.num_scheduled_tokens == 8
        owners += out.scheduled[0].request_id[0]
    return owners


def test_prompt_chunks_alternate_between_tenants() -> None:
    """A long prompt runs; another tenant's arrives: from then on the budget's chunks alternate
    (the newcomer starts level with the lowest counter, ties by arrival), not a's prompt first."""
    sched = make_scheduler(max_seqs=4, budget=8)
    add(sched, "a", num_prompt=200)
    assert prompt_owners(sched, 1) == "a"
    add(sched, "b", num_prompt=200)
    assert prompt_owners(sched, 8) == "abababab"


def test_prompt_chunks_follow_weights_two_to_one() -> None:
    sched = make_scheduler(max_seqs=4, budget=8, weights={"a": 2.0})
    add(sched, "a", num_prompt=200)
    assert prompt_owners(sched, 1) == "a"
    add(sched, "b", num_prompt=200)
    assert prompt_owners(sched, 9) == "abaabaaba"


def test_three_tenants_prompt_chunks_round_robin() -> None:
    sched = make_scheduler(max_seqs=4, budget=8)
    add(sched, "a", num_prompt=200)
    add(sched, "b", num_prompt=200)
    add(sched, "c", num_prompt=200)
    assert prompt_owners(sched, 9) == "abcabcabc"


def test_a_lighter_tenants_short_prompt_runs_in_a_step_of_its_own() -> None:
    """a decodes 3 streams; b's short prompt arrives: that step computes b's prompt alone (a's
    decodes sit out one step), then everyone decodes together. A prompt too long for one step
    shares its steps with a's decodes instead, and a tenant's own new request never holds back
    its other streams."""
    sched = make_scheduler(max_seqs=8, budget=16)
    a = add(sched, "a", 3, num_prompt=4)
    step(sched)
    b = add(sched, "b", num_prompt=6)
    assert [(s.request_id, len(s.token_ids)) for s in step(sched).scheduled] == [(b[0], 6)]
    assert sorted(s.request_id for s in step(sched).scheduled) == sorted([*a, *b])
    long_prompt = add(sched, "c", num_prompt=40)
    out = step(sched)
    assert {s.request_id for s in out.scheduled} == {*a, *b, *long_prompt}
    a_more = add(sched, "a", num_prompt=3)
    out = step(sched)
    assert {*a, *b} <= {s.request_id for s in out.scheduled} and a_more[0] in {
        s.request_id for s in out.scheduled
    }


def test_decodes_go_first_and_the_rest_is_shared() -> None:
    """A decodes one token per step beside b's prompt chunks: a's decode is never skipped and b's
    chunks take the rest of the budget."""
    sched = make_scheduler(max_seqs=4, budget=8)
    add(sched, "a", num_prompt=4)
    step(sched)  # a's prompt, first token
    add(sched, "b", num_prompt=100)
    for _ in range(5):
        out = step(sched)
        assert [(s.request_id[0], len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_preemption_picks_the_tenant_most_over_its_share() -> None:
    """Blocks run out: the victim is the latest request of the tenant with the highest counter,
    not the latest arrival overall."""
    sched = make_scheduler(max_seqs=8, budget=64, num_blocks=7)
    a = add(sched, "a", 3, num_prompt=7)  # 2 blocks each, the 2nd full after one decode
    step(sched)
    b = add(sched, "b", 1, num_prompt=1)  # 1 block, the latest arrival
    assert [s.request_id for s in step(sched).scheduled] == [b[0]]  # its prompt first, alone
    step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    assert sched.fair.counter(sched.requests[a[0]]) > sched.fair.counter(sched.requests[b[0]])
    out = step(sched)  # a's requests each need a 3rd block for their 9th token
    assert out.preempted_request_ids[0] == a[2]
    assert b[0] not in out.preempted_request_ids


def test_idle_tenants_do_not_bank_credit() -> None:
    """A tenant arriving after a long time away starts at the lowest active counter, so it does
    not get the whole budget for as long as the others were served."""
    sched = make_scheduler(max_seqs=4, budget=8)
    add(sched, "a", num_prompt=400)
    prompt_owners(sched, 20)
    add(sched, "b", num_prompt=400)
    b_request = next(r for r in sched.waiting if r.tenant_id == "b")
    assert sched.fair.counter(b_request) == 20 * 8


def test_weights_carried_by_requests_change_shares_live() -> None:
    """No configured weights: requests carrying their tenant's weight (set live by the operator,
    `Request.tenant_weight`) make seats follow it, and a later request with a new weight moves
    them again."""

    def add_weighted(sched: Scheduler, tenant: str, count: int, weight: float) -> None:
        for _ in range(count):
            arrival = next(ARRIVALS)
            sched.add_request(
                Request(
                    f"{tenant}{arrival}",
                    [1, 2, 3, 4],
                    SamplingParams(max_tokens=100, ignore_eos=True),
                    tenant_id=tenant,
                    tenant_weight=weight,
                    arrival_time=float(arrival),
                )  # fmt: skip
            )

    sched = make_scheduler(max_seqs=6)
    add_weighted(sched, "a", 8, 2.0)
    step(sched)
    add_weighted(sched, "b", 8, 1.0)
    step(sched)
    assert seats(sched) == {"a": 4, "b": 2}
    add_weighted(sched, "b", 1, 4.0)  # the operator raised b's weight: b now gets 4 of 6
    for _ in range(3):
        step(sched)
    assert seats(sched) == {"a": 2, "b": 4}
