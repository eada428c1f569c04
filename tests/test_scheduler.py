"""Scheduler: token budget, chunked prefill, priority, preemption, abort; and a state machine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched.batch_policy import BatchPolicy
from tandem.engine.sched.fair_share import FairShare
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import RunnerResult, SchedulerOutput

EOS = 0


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    fair_share: FairShare | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, watermark=0.0)
    return Scheduler(
        kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64, fair_share=fair_share
    )


def make_request(
    rid: str,
    num_prompt: int,
    max_tokens: int = 4,
    priority: Priority = Priority.INTERACTIVE,
    arrival: float = 0.0,
) -> Request:
    return Request(
        rid,
        list(range(1, num_prompt + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=arrival,
    )


def fake_run(out: SchedulerOutput, token: int = 7) -> RunnerResult:
    return RunnerResult({item.request_id: [token] for item in out.scheduled if item.sample})


def test_chunked_prefill_and_decode_share_one_budget() -> None:
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", 3, arrival=0))
    sched.add_request(make_request("b", 20, arrival=1))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("a", 3, True),
        ("b", 7, False),
    ]
    sched.update_from_output(out, fake_run(out))
    out = sched.schedule()  # a decodes 1, b continues its prompt with the other 9
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 3, 1),
        ("b", 7, 9),
    ]
    assert out.num_scheduled_tokens == 10


def test_interactive_admitted_before_batch_and_batch_preempted_first() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("batch", 8, max_tokens=20, priority=Priority.BATCH, arrival=0))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    # The interactive request needs 3 blocks; 2 are free: the batch request gives way.
    sched.add_request(make_request("chat", 12, priority=Priority.INTERACTIVE, arrival=1))
    out = sched.schedule()
    assert out.preempted_request_ids == ["batch"]
    assert [s.request_id for s in out.scheduled] == ["chat"]
    assert sched.requests["batch"].status is RequestStatus.PREEMPTED
    assert sched.requests["batch"].num_computed_tokens == 0
    sched.check_integrity()


def test_interactive_takes_the_seat_of_the_latest_batch_request_when_max_num_seqs_is_reached() -> None:
    """KV has room but every seat is taken by batch requests: the interactive request preempts
    the latest-arriving one instead of waiting for a (throttled) batch request to finish; two
    interactive requests never preempt each other."""
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=3)
    for i in range(3):
        sched.add_request(make_request(f"b{i}", 4, max_tokens=40, priority=Priority.BATCH, arrival=i))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    assert sched.num_output_tokens_total == {Priority.INTERACTIVE: 0, Priority.BATCH: 3}
    sched.add_request(make_request("chat", 4, arrival=10))
    out = sched.schedule()
    assert out.preempted_request_ids == ["b2"]
    assert "chat" in [s.request_id for s in out.scheduled]
    assert sorted(r.request_id for r in sched.running) == ["b0", "b1", "chat"]
    sched.update_from_output(out, fake_run(out))
    sched.check_integrity()
    sched.add_request(make_request("chat2", 4, arrival=11))
    sched.add_request(make_request("chat3", 4, arrival=12))
    out = sched.schedule()
    assert out.preempted_request_ids == ["b1", "b0"]
    assert sorted(r.request_id for r in sched.running) == ["chat", "chat2", "chat3"]
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("chat4", 4, arrival=13))
    out = sched.schedule()  # all seats interactive: chat4 waits its turn
    assert out.preempted_request_ids == [] and "chat4" not in [s.request_id for s in out.scheduled]
    sched.check_integrity()


def test_running_request_preempts_latest_lowest_priority_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("old", 4, max_tokens=30, arrival=0))
    sched.add_request(make_request("new", 8, max_tokens=30, arrival=1))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))  # old: 5 tokens (2 blocks), new: 9 tokens... 3 blocks?
    # 4 blocks total: old holds 1, new holds 2; next step old needs a 2nd block, new needs a 3rd.
    out = sched.schedule()
    assert out.preempted_request_ids == ["new"]
    assert [s.request_id for s in out.scheduled] == ["old"]
    sched.check_integrity()
    # Recompute: when it comes back, the whole prompt + generated tokens are scheduled again.
    victim = sched.requests["new"]
    assert victim.num_tokens == 9 and victim.num_preemptions == 1


def test_abort_frees_blocks_immediately_and_runner_is_told() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    out = sched.schedule()
    assert sched.kv.pool.num_used_blocks == 3
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_used_blocks == 0
    sched.update_from_output(out, fake_run(out))  # result of the in-flight step is dropped
    assert sched.schedule().finished_request_ids == ["a"]
    sched.check_integrity()


def test_stop_conditions() -> None:
    sched = make_scheduler()
    req = make_request("a", 2, max_tokens=3)
    req.sampling_params = SamplingParams(max_tokens=3, stop_token_ids=[9])
    req.eos_token_ids = frozenset({EOS})
    sched.add_request(req)
    out = sched.schedule()
    [update] = sched.update_from_output(out, fake_run(out, token=9))
    assert update.finished and req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    sched.add_request(make_request("b", 2, max_tokens=2))
    for _ in range(2):
        out = sched.schedule()
        updates = sched.update_from_output(out, fake_run(out, token=EOS))  # ignore_eos=True
    assert updates[0].finished and updates[0].request.status is RequestStatus.FINISHED_LENGTH


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort with tight memory; `check_integrity()` after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=4)
        self.counter = 0
        self.finished: set[str] = set()
        self.expected_outputs: dict[str, int] = {}

    @rule(num_prompt=st.integers(1, 30), max_tokens=st.integers(1, 12), batch=st.booleans())
    def add(self, num_prompt: int, max_tokens: int, batch: bool) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        prio = Priority.BATCH if batch else Priority.INTERACTIVE
        self.sched.add_request(make_request(rid, num_prompt, max_tokens, prio, arrival=float(self.counter)))
        self.expected_outputs[rid] = max_tokens

    @rule()
    def step(self) -> None:
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= 16
        assert len(out.scheduled) <= 4
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        for item in out.scheduled:
            table = self.sched.kv.block_table(item.request_id)
            assert len(table.block_ids) * 4 >= item.start_position + len(item.token_ids)
        for update in self.sched.update_from_output(out, fake_run(out)):
            if update.finished:
                rid = update.request.request_id
                assert update.request.num_output_tokens == self.expected_outputs[rid]
                self.finished.add(rid)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        assert rid not in self.sched.kv.tables

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    def teardown(self) -> None:
        # Liveness: with no new arrivals every request finishes (within a bound that grows with
        # the requests left: a request of n choices is n of them).
        for _ in range(500 + 10 * len(self.sched.requests)):
            if not self.sched.has_unfinished():
                break
            self.step()
            self.sched.check_integrity()
        assert not self.sched.has_unfinished(), "scheduler stalled"
        assert self.sched.kv.pool.num_used_blocks == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class TenantSchedulerMachine(SchedulerMachine):
    """The same random add / step / abort, with requests of three tenants (one weighted 2:1):
    integrity after every rule, every request finishes with its tokens, fair-share bookkeeping
    counts exactly the live requests, and counters never go down."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = make_scheduler(
            num_blocks=12, block_size=4, budget=16, max_seqs=4, fair_share=FairShare({"t0": 2.0})
        )
        self.last_counters: dict = {}

    @rule(
        num_prompt=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        batch=st.booleans(),
        tenant=st.sampled_from(["t0", "t1", "t2"]),
    )
    def add_for_tenant(self, num_prompt: int, max_tokens: int, batch: bool, tenant: str) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        prio = Priority.BATCH if batch else Priority.INTERACTIVE
        request = make_request(rid, num_prompt, max_tokens, prio, arrival=float(self.counter))
        request.tenant_id = tenant
        self.sched.add_request(request)
        self.expected_outputs[rid] = max_tokens

    @invariant()
    def fair_bookkeeping(self) -> None:
        live: dict = {}
        for request in self.sched.requests.values():
            key = (request.priority, request.tenant_id)
            live[key] = live.get(key, 0) + 1
        assert dict(self.sched.fair.live) == live
        for key, value in self.last_counters.items():
            assert self.sched.fair.counters[key] >= value
        self.last_counters = dict(self.sched.fair.counters)


TestTenantSchedulerMachine = TenantSchedulerMachine.TestCase
TestTenantSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class ParallelSamplingMachine(SchedulerMachine):
    """The same random add / step / abort, plus requests of n choices (`choice_requests`): block
    ref counts stay exact while choices share their leader's prompt blocks (`check_integrity`),
    a choice never computes its shared prompt tokens again, and every choice finishes with its
    tokens though leaders are preempted or aborted under it."""

    @rule(
        num_prompt=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        n=st.integers(2, 4),
        batch=st.booleans(),
    )
    def add_family(self, num_prompt: int, max_tokens: int, n: int, batch: bool) -> None:
        from tandem.engine.sched.parallel_sampling import choice_requests

        rid = f"f{self.counter}"
        self.counter += 1
        prio = Priority.BATCH if batch else Priority.INTERACTIVE
        parent = make_request(rid, num_prompt, max_tokens, prio, arrival=float(self.counter))
        parent.sampling_params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        for child in choice_requests(parent):
            self.sched.add_request(child)
            self.expected_outputs[child.request_id] = max_tokens

    @rule()
    def step_checking_forks(self) -> None:
        """A step in which no choice that forked computes a token of its shared blocks."""

        def shared(request: Request) -> int:
            return (request.num_prompt_tokens - 1) // 4 * 4

        ready = {  # choices whose leader runs with their shared blocks computed
            r.request_id: shared(r)
            for r in self.sched.waiting
            if r.fork_of is not None
            and (leader := self.sched.requests.get(r.fork_of)) is not None
            and leader.status is RequestStatus.RUNNING
            and leader.num_computed_tokens >= shared(r)
        }
        out = self.sched.schedule()
        for item in out.scheduled:
            if item.request_id in ready and item.is_new:
                assert item.start_position >= ready[item.request_id], (item.request_id, item.start_position)
        for update in self.sched.update_from_output(out, fake_run(out)):
            if update.finished:
                rid = update.request.request_id
                assert update.request.num_output_tokens == self.expected_outputs[rid]
                self.finished.add(rid)


TestParallelSamplingMachine = ParallelSamplingMachine.TestCase
TestParallelSamplingMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_choices_wait_for_their_leader_then_share_its_prompt_blocks() -> None:
    from tandem.engine.sched.parallel_sampling import choice_requests

    sched = make_scheduler(num_blocks=16, block_size=4, budget=8)
    parent = make_request("p", 10, max_tokens=3)
    parent.sampling_params = SamplingParams(n=3, max_tokens=3, ignore_eos=True)
    for child in choice_requests(parent):
        sched.add_request(child)
    first = sched.schedule()  # the leader's first chunk only: the others wait for its prompt
    assert [(s.request_id, len(s.token_ids)) for s in first.scheduled] == [("p#0", 8)]
    sched.update_from_output(first, fake_run(first))
    # Its full blocks are computed: the choices start beside its last chunk, each computing only
    # the last, partial block of the prompt.
    second = sched.schedule()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in second.scheduled] == [
        ("p#0", 8, 2),
        ("p#1", 8, 2),
        ("p#2", 8, 2),
    ]
    tables = [sched.kv.block_table(f"p#{i}").block_ids for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the two full prompt blocks, shared
    assert len({t[2] for t in tables}) == 3  # the partial one: each its own
    assert all(sched.kv.pool.ref_counts[b] == 3 for b in tables[0][:2])
    sched.check_integrity()


def test_batch_requests_only_fill_idle_capacity() -> None:
    """Batch work is admitted while KV occupancy (its whole prompt counted) stays under the limit,
    its prefill chunks are capped, and interactive work is never held back by it."""
    kv = KVCacheManager(10, 4, watermark=0.0)
    sched = Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, batch=BatchPolicy(kv_occupancy_limit=0.4, max_prefill_tokens=6, tokens_under_load=32))  # fmt: skip
    sched.add_request(make_request("b1", 12, priority=Priority.BATCH, arrival=0))  # 3 blocks
    sched.add_request(make_request("b2", 12, priority=Priority.BATCH, arrival=1))  # 2 used + 3 > 4
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("b1", 6)]  # capped chunk
    assert [r.request_id for r in sched.waiting] == ["b2"]
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("i1", 16, arrival=2))  # interactive: no cap, no occupancy limit
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("i1", 16), ("b1", 6)]
    assert [r.request_id for r in sched.waiting] == ["b2"]  # 7 of 10 blocks used: b2 still waits
    sched.check_integrity()


def test_waiting_interactive_goes_before_running_batch_and_batch_is_throttled() -> None:
    sched = Scheduler(
        KVCacheManager(64, 4, watermark=0.0), max_num_seqs=16, max_num_batched_tokens=16,
        max_model_len=64, batch=BatchPolicy(max_prefill_tokens=16, tokens_under_load=2))  # fmt: skip
    for i in range(4):
        sched.add_request(make_request(f"b{i}", 2, max_tokens=8, priority=Priority.BATCH, arrival=i))
    out = sched.schedule()  # no interactive traffic: batch may use the whole budget
    assert [s.request_id for s in out.scheduled] == ["b0", "b1", "b2", "b3"]
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("i0", 14, arrival=10))
    out = sched.schedule()  # the new interactive prompt first; batch shares 2 tokens
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("i0", 14), ("b0", 1), ("b1", 1)]
    sched.update_from_output(out, fake_run(out))
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)  # paused, not preempted
    sched.check_integrity()


def test_batch_throttle_caps_batch_tokens_even_with_budget_to_spare() -> None:
    """Under interactive load batch requests share `batch_tokens_under_load` tokens although the
    step has budget left (so the cap, not an empty budget, is what holds them back)."""
    sched = Scheduler(
        KVCacheManager(64, 4, watermark=0.0), max_num_seqs=16, max_num_batched_tokens=64,
        max_model_len=64, batch=BatchPolicy(max_prefill_tokens=16, tokens_under_load=2))  # fmt: skip
    for i in range(4):
        sched.add_request(make_request(f"b{i}", 2, max_tokens=8, priority=Priority.BATCH, arrival=i))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("i0", 14, arrival=10))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("i0", 14), ("b0", 1), ("b1", 1)]
    assert out.num_scheduled_tokens == 16 < sched.max_num_batched_tokens


def test_batch_steps_stay_short_for_a_while_after_interactive_traffic() -> None:
    """While an interactive request runs, batch gets `batch_tokens_under_load` tokens per step; for
    `interactive_quiet_s` after it left, at most `batch_tokens_after_interactive`; then the whole
    budget again."""
    kv = KVCacheManager(64, 4, watermark=0.0)
    now = [0.0]
    sched = Scheduler(
        kv,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        batch=BatchPolicy(
            max_prefill_tokens=64,
            tokens_under_load=1,
            tokens_after_interactive=3,
            interactive_quiet_s=2.0,
            clock=lambda: now[0],
        ),
    )
    for i in range(8):
        sched.add_request(make_request(f"b{i}", 2, max_tokens=30, priority=Priority.BATCH, arrival=i))

    def batch_tokens(out: SchedulerOutput) -> int:
        return sum(len(s.token_ids) for s in out.scheduled if s.request_id.startswith("b"))

    out = sched.schedule()
    assert batch_tokens(out) == 16  # no interactive traffic yet: every prompt at once
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("chat", 2, max_tokens=1, arrival=10))
    out = sched.schedule()
    assert batch_tokens(out) == 1
    sched.update_from_output(out, fake_run(out))  # chat finishes (max_tokens=1)
    now[0] = 1.5
    out = sched.schedule()
    assert batch_tokens(out) == 3
    sched.update_from_output(out, fake_run(out))
    now[0] = 2.5
    out = sched.schedule()
    assert batch_tokens(out) == 8
    sched.check_integrity()


def test_a_step_computing_an_interactive_prompt_carries_no_batch_tokens() -> None:
    """With `batch_tokens_beside_interactive_prompt=0`, the steps of an interactive prompt (all its
    chunks) hold no batch tokens; once it decodes, batch requests get `batch_tokens_under_load`
    again; a step of interactive decodes only is not a prompt step."""
    sched = Scheduler(
        KVCacheManager(64, 4, watermark=0.0), max_num_seqs=16, max_num_batched_tokens=8,
        max_model_len=64, batch=BatchPolicy(max_prefill_tokens=8, tokens_under_load=2, tokens_beside_interactive_prompt=0))  # fmt: skip
    for i in range(4):
        sched.add_request(make_request(f"b{i}", 2, max_tokens=20, priority=Priority.BATCH, arrival=i))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("chat", 12, max_tokens=4, arrival=10))

    def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
        return [(s.request_id, len(s.token_ids)) for s in out.scheduled]

    out = sched.schedule()  # first chunk: 8 of 12 prompt tokens, the budget
    assert ids(out) == [("chat", 8)]
    sched.update_from_output(out, fake_run(out))
    out = sched.schedule()  # last chunk (4 tokens) with budget to spare: still no batch tokens
    assert ids(out) == [("chat", 4)]
    sched.update_from_output(out, fake_run(out))
    out = sched.schedule()  # chat decodes: batch shares 2 tokens again
    assert ids(out) == [("chat", 1), ("b0", 1), ("b1", 1)]
    sched.update_from_output(out, fake_run(out))
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)  # paused, not preempted
    sched.check_integrity()


def test_among_running_batch_requests_the_latest_arrival_is_preempted_first() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"b{i}", 4, max_tokens=20, priority=Priority.BATCH, arrival=i))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))  # each holds 2 blocks (5 tokens): all 6 used
    sched.add_request(make_request("chat", 4, arrival=10))  # needs 1 block (+1 to decode)
    out = sched.schedule()
    assert out.preempted_request_ids == ["b2"]
    assert {s.request_id for s in out.scheduled} >= {"chat", "b0"}
    sched.check_integrity()


def test_a_preempted_batch_decoder_gives_back_its_share_of_the_step() -> None:
    """The case the state machine found: with batch tokens going to decoders first, a batch
    request still in its prompt may need blocks held by a decoder already scheduled this step;
    that decoder is preempted and leaves the step (no scheduled item without a block table)."""
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=4)
    sched.add_request(make_request("r0", 22, max_tokens=1, priority=Priority.BATCH, arrival=1))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    sched.add_request(make_request("r1", 18, max_tokens=1, priority=Priority.BATCH, arrival=2))
    sched.add_request(make_request("r2", 1, max_tokens=5, priority=Priority.BATCH, arrival=3))
    for _ in range(4):
        out = sched.schedule()
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
    sched.add_request(make_request("r3", 1, max_tokens=1, arrival=4))
    for _ in range(20):
        out = sched.schedule()
        for item in out.scheduled:
            table = sched.kv.block_table(item.request_id)
            assert len(table.block_ids) * 4 >= item.start_position + len(item.token_ids)
        assert not set(out.preempted_request_ids) & {s.request_id for s in out.scheduled}
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()


class MixedCompressionMachine(SchedulerMachine):
    """The same random add / step / abort, with some requests compressed: they live in a small
    head-block pool (2 layers x 2 KV heads), are evicted (random kept sets) once their context is
    computed and then every 3 decode steps (observed over the last 2), and preempt only each
    other for head blocks. Integrity of both pools after every rule; every request finishes with
    its tokens; both pools end empty."""

    def __init__(self) -> None:
        super().__init__()
        from tandem.engine.kv.head_cache import HeadKVCacheManager

        self.head_kv = HeadKVCacheManager(
            48, 4, num_layers=2, num_kv_heads=2
        )  # one 42-token request alone fits
        kv = KVCacheManager(12, 4, watermark=0.0)
        kv.enable_prefix_caching = True  # prompts share prefixes: compressed ones copy them
        self.sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                               head_kv=self.head_kv, eviction_interval=3, eviction_window=2)  # fmt: skip
        self.rng = __import__("random").Random(0)
        self.num_prefix_copies = 0

    @rule(num_prompt=st.integers(1, 30), max_tokens=st.integers(1, 12), batch=st.booleans())
    def add_compressed(self, num_prompt: int, max_tokens: int, batch: bool) -> None:
        rid = f"c{self.counter}"
        self.counter += 1
        request = make_request(rid, num_prompt, max_tokens, Priority.BATCH if batch else Priority.INTERACTIVE,
                               arrival=float(self.counter))  # fmt: skip
        request.kv_compression_rate = 4.0
        self.sched.add_request(request)
        self.expected_outputs[rid] = max_tokens

    @rule()
    def step(self) -> None:
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= 16
        result = fake_run(out)
        for item in out.scheduled:
            request = self.sched.requests[item.request_id]
            if not request.compressed:
                assert item.head is None
                table = self.sched.kv.block_table(item.request_id)
                assert len(table.block_ids) * 4 >= item.start_position + len(item.token_ids)
                continue
            head = item.head
            assert head is not None and item.block_ids == []
            assert all(len(slots) == len(item.token_ids) for slots in head.slots)
            if head.prefix_src_slots:  # a cached prefix, held in shared blocks until the step ends
                num_copied = len(head.prefix_src_slots)
                assert item.start_position == num_copied
                assert request.num_preemptions or request.num_cached_tokens == num_copied
                assert num_copied <= request.num_tokens - 2  # the observation window is computed
                assert all(len(slots) == num_copied for slots in head.prefix_dst_slots)
                shared = self.sched.kv.block_table(item.request_id).block_ids
                assert {slot // 4 for slot in head.prefix_src_slots} == set(shared)
            assert head.num_tokens == self.head_kv.num_tokens(item.request_id)
            if not request.kv_evicted:  # the context's eviction
                assert head.observe == head.evict == item.sample
            else:  # decode evictions: observed over the last 2 of every 3 steps, the last evicting
                since = item.start_position + len(item.token_ids) - request.num_tokens_at_eviction
                assert item.sample and 1 <= since <= 3
                assert (head.observe, head.evict) == (since > 1, since == 3)
            if head.evict:
                result.kept_tokens[item.request_id] = [
                    sorted(self.rng.sample(range(n), self.rng.randint(1, n))) for n in head.num_tokens
                ]
        moves = len(out.head_move_src_slots) == len(out.head_move_dst_slots)
        assert moves
        for update in self.sched.update_from_output(out, result):
            if update.finished:
                rid = update.request.request_id
                assert update.request.num_output_tokens == self.expected_outputs[rid]
                self.finished.add(rid)
        for item in out.scheduled:  # compressed requests hold no shared block after their step
            request = self.sched.requests.get(item.request_id)
            assert request is None or not request.compressed or item.request_id not in self.sched.kv.tables
        self.num_prefix_copies += sum(1 for item in out.scheduled if item.head and item.head.prefix_src_slots)

    def teardown(self) -> None:
        super().teardown()
        assert self.head_kv.pool.num_used_blocks == 0


TestMixedCompressionMachine = MixedCompressionMachine.TestCase
TestMixedCompressionMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
