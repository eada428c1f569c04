"""`StepPipeline`: the engine's steps with the next one scheduled while the device runs the current.

A runner whose steps run on a device (`overlappable`: its `execute` may run on a thread of its own
and reads only its `SchedulerOutput`) gets its steps from a single device thread. While step N runs
there, the engine thread schedules step N+1 from the state step N leaves (`sched/in_flight.py`:
one placeholder token per sampling request), then waits for step N's results, puts its tokens in
place and drops from step N+1 the requests they end, hands step N+1 to the device, and only then
does the rest of step N's bookkeeping and turns it into outputs (detokenisation, stop strings,
`RequestOutput`s) while step N+1 runs. A request that a stop string ends is in the step already
running: its token there is dropped (as vLLM's asynchronous scheduling does). When the next step
could preempt (`Scheduler.can_schedule_ahead`) the running step's results are applied first.

Chained steps: while step N still runs, where no request of step N+1 is constrained by a grammar
(its matcher advances with every token the runner samples), step N+1 is queued on the device
thread before step N's results are in, so the device goes from one step to the next without
waiting for the engine thread: the device thread puts step N's tokens in place of step N+1's
placeholders itself (`in_flight.with_tokens_of`; a penalised request reads its own copy of its
output there, step N's token included). Such a step also computes the requests that step N's
token ends (a stop token; one that reaches its length limit is left out beforehand, a row nobody
would read): their results are dropped (the engine's record of the step is rebased as above),
and their KV goes to blocks that only later steps, run after it on the same thread, can reuse.
When step N is done already the device is idle: step N+1 goes as above (nothing to gain from
queueing it early).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tandem.engine.protocol import RequestOutput
from tandem.engine.request import RequestStatus
from tandem.engine.sched.in_flight import InFlightStep, with_tokens_of
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import (
    PLACEHOLDER_TOKEN,
    RequestUpdate,
    Runner,
    RunnerResult,
    ScheduledRequest,
    SchedulerOutput,
)


class StepPipeline:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        end_stale: Callable[[list[str]], list[RequestOutput]],
        fail_requests: Callable[[RunnerResult, int], list[RequestOutput]],
        outputs: Callable[[list[RequestUpdate]], list[RequestOutput]],
        mark_scheduled: Callable[[list[str], float], None],
    ) -> None:
        """The callables are the engine's: end stale requests (KV integrity), end the requests a
        result failed, make outputs from updates, note first-scheduled times."""
        self.scheduler = scheduler
        self.runner = runner
        self.end_stale = end_stale
        self.fail_requests = fail_requests
        self.outputs = outputs
        self.mark_scheduled = mark_scheduled
        # a runner with per-thread device state (CUDA's current device) binds the device thread to it
        bind = getattr(runner, "bind_thread", None)
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-device", initializer=bind)
        self._in_flight: tuple[InFlightStep, Future[RunnerResult]] | None = None
        self.num_steps = 0  # steps whose results were applied
        self.num_steps_ahead = 0  # of which the next step was scheduled while they ran
        self.num_steps_chained = 0  # steps queued on the device before the step before's results
        self.wait_s = 0.0  # the engine thread's seconds waiting for the device

    def step(self) -> list[RequestOutput]:
        """Schedule the next step (ahead of the running one's results where it cannot preempt),
        fill the running one's tokens in, start the next one, then finish applying the results
        and return their outputs."""
        if self._in_flight is not None and not self.scheduler.can_schedule_ahead():
            scheduled = None  # the next step is scheduled from the applied results (next call)
            ended: list[RequestOutput] = []
        else:
            scheduled = self.scheduler.schedule()
            ended = self.end_stale(scheduled.stale_request_ids)
        previous, self._in_flight = self._in_flight, None
        chained: Future[RunnerResult] | None = None
        if previous is not None and not previous[1].done() and scheduled is not None:
            chained = self._chain(scheduled, previous[1])  # the device is busy: keep it so
        filled: tuple[InFlightStep, RunnerResult, dict[str, RequestStatus | None]] | None = None
        if previous is not None:
            filled = self._fill(*previous)
            if scheduled is not None:
                self.num_steps_ahead += 1
        if filled is not None and chained is not None and scheduled is not None:
            self._track(scheduled, filled[2], chained)
        elif scheduled is not None and not scheduled.is_empty:
            self._submit(scheduled, filled[2] if filled is not None else None)
        if filled is None:
            return ended
        in_flight, result, ending = filled
        ended += self.fail_requests(result, len(in_flight.scheduled.scheduled))
        updates = self.scheduler.updates.apply_filled(in_flight.scheduled, result, ending)
        self.num_steps += 1
        return ended + self.outputs(updates)

    def _submit(self, scheduled: SchedulerOutput, ending: dict[str, RequestStatus | None] | None) -> None:
        """Hand a step to the device; `ending`: the step was scheduled ahead of the one just filled
        (`InFlightStep.begin` rebases it)."""
        now = time.monotonic()
        in_flight = InFlightStep.begin(scheduled, self.scheduler.requests, ending)
        scheduled = in_flight.scheduled
        if scheduled.is_empty:  # every request of it ended in the step before
            return
        started = threading.Event()

        def run() -> RunnerResult:
            started.set()
            return self.runner.execute(scheduled)

        self._in_flight = (in_flight, self._device.submit(run))
        # Wait (GIL free) until the device thread runs: else it could wait for the GIL as long as
        # this thread's outputs and scheduling keep it (up to the interpreter's switch interval).
        started.wait()
        self.mark_scheduled([s.request_id for s in scheduled.scheduled if s.is_new], now)

    def _chain(
        self, scheduled: SchedulerOutput, running: Future[RunnerResult]
    ) -> Future[RunnerResult] | None:
        """Queue a step on the device behind the running one (`with_tokens_of` there), without the
        requests that the running step's token brings to their length limit; a penalised request
        reads a copy of its output there (`output_ends`: its output tokens known now). None (not
        queued) for an empty step or one with a constrained request (a grammar's matcher advances
        with each token the runner samples, past a request's end too)."""
        requests, at_limit = self.scheduler.requests, self.scheduler.updates.at_length_limit
        items: list[ScheduledRequest] = []
        output_ends: dict[str, int] = {}
        if scheduled.is_empty:
            return None
        for item in scheduled.scheduled:
            if item.sampling_params.structured is not None:
                return None
            placeholder = item.token_ids[-1] == PLACEHOLDER_TOKEN
            if placeholder and at_limit(requests[item.request_id]):
                continue
            if item.sampling_params.has_penalties:
                output_ends[item.request_id] = len(item.output_token_ids) - placeholder
            items.append(item)
        device_step = scheduled.with_items(items)

        def run() -> RunnerResult:
            sampled = running.result().sampled_token_ids  # this thread ran it: done
            step = with_tokens_of(device_step, sampled, output_ends)
            return self.runner.execute(step) if step.scheduled else RunnerResult({})

        self.num_steps_chained += 1
        return self._device.submit(run)

    def _track(
        self,
        scheduled: SchedulerOutput,
        ending: dict[str, RequestStatus | None],
        future: Future[RunnerResult],
    ) -> None:
        """The engine's record of a chained step, now that the step before it is filled in: rebased
        as `_submit` rebases (the device computes the ending requests too; nobody reads those)."""
        now = time.monotonic()
        in_flight = InFlightStep.begin(scheduled, self.scheduler.requests, ending)
        if in_flight.scheduled.is_empty:  # every request of it ended in the step before
            return  # the device still runs it, before any step queued after it
        self._in_flight = (in_flight, future)
        self.mark_scheduled([s.request_id for s in in_flight.scheduled.scheduled if s.is_new], now)

    def _fill(
        self, in_flight: InFlightStep, future: Future[RunnerResult]
    ) -> tuple[InFlightStep, RunnerResult, dict[str, RequestStatus | None]]:
        """Wait for a step's results and put its tokens in place; who ends there."""
        started = time.perf_counter()
        try:
            result = future.result()
        finally:
            self.wait_s += time.perf_counter() - started
        ending = in_flight.fill(result, self.scheduler.updates.check_stop)  # who stops at their token
        return in_flight, result, ending
