"""Requests whose caller died: found by the LLM replica, aborted in its engine, metered.

A caller in another process (an ingress replica, a batch worker) sends with each request a
`CallerRef`: its Ray actor's name and, for a metered real-time request, what its usage record
names (`UsageTag`). When that process dies mid-stream, Ray does not cancel the replica's side of
the stream: the engine would run the request to its end for nobody, and the tokens the client
was sent would never be metered (the caller's meter died with it). The replica's `OrphanWatch`
looks the callers of its running requests up every `check_s` (`ray.get_actor` by name: a dead
actor's name is gone; Serve never restarts a replica under the same name); for a caller that is
gone it aborts each of its requests and records each metered one `cancelled` with the tokens
streamed to the caller (`RequestMeter`), through the replica's own usage log. A request whose
caller lives is metered by the caller, as always: each request is metered once.

Over gRPC (Serve's throughput-optimized mode, the default: cli/serve_config.py) a caller's death
does close the replica's side of the stream, at once: the engine stops the request then, and
`cut` meters it if look-ups from then on find the caller dead within a few seconds (Ray's
control store learns of a death a moment after it; a living caller closes a stream when its
client left, and meters it itself).

A stream whose caller died must also not *end* early. At the end of a streamed call Ray's
executor waits, on the replica's event loop that carries every stream of the replica, until
each output it sent has been acknowledged by the caller; to a dead caller those sends fail only
once Ray has confirmed the death, a second or more later, and every other stream of the replica
stalls meanwhile. So a stream with a caller ends only after `OrphanWatch.settle`: once a
look-up of the caller begun after the stream's last output finds it alive (its
acknowledgements arrive within milliseconds), or `hold_s` after the caller was found dead (its
sends have failed by then). A caller ends its side at the request's final output and does not
wait for the close. Look-ups of one caller are shared and at most one per
`min_lookup_interval_s`, so the control store sees a bounded rate however many requests end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tandem.deployments.usage_metering import RequestMeter
from tandem.engine.protocol import RequestOutput
from tandem.platform.usage_log import UsageLog

logger = logging.getLogger("tandem.replica")


@dataclass(frozen=True)
class UsageTag:
    """What a real-time request's usage record names besides its tenant (`RequestMeter`)."""

    api_key_id: str | None
    model: str  # as the client named it
    adapter: str | None


@dataclass(frozen=True)
class CallerRef:
    """The process that sent a request (a named Ray actor), and its usage tag if it meters it."""

    actor_name: str
    namespace: str
    usage: UsageTag | None = None


# Where Ray Serve registers its replicas' actors (its controller's namespace), which need not be
# the namespace of the job that started Serve.
SERVE_NAMESPACE = "serve"


def current_caller(usage: UsageTag | None) -> CallerRef | None:
    """This process as a caller: its actor's name and the namespace it is found under (None
    outside a named Ray actor, e.g. a test's own process, or when the lookup does not find it:
    then nothing watches for its death rather than taking it for dead)."""
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    try:
        name = context.get_actor_name()
    except Exception:  # noqa: BLE001 - not an actor
        return None
    if not name:
        return None
    for namespace in dict.fromkeys((SERVE_NAMESPACE, context.namespace)):
        ref = CallerRef(name, namespace, usage)
        if caller_alive(ref):
            return ref
    logger.warning(
        "this process is not found by its actor name; its requests are not watched", extra={"name": name}
    )
    return None


def caller_alive(caller: CallerRef) -> bool:
    """Whether the caller's actor still exists (a blocking lookup in Ray's control store)."""
    import ray

    try:
        ray.get_actor(caller.actor_name, namespace=caller.namespace)
    except ValueError:  # no actor by that name: it died
        return False
    return True


# How long a stream of a dead caller stays open after the death was found: well over what Ray
# takes to fail the outputs it still sends there (docs/performance.md), far under a request's life.
HOLD_S = 10.0


@dataclass
class _Running:
    caller: CallerRef
    tenant: str | None
    meter: RequestMeter | None = None
    ended: bool = False  # its stream ended (`settle`): not aborted or metered here
    orphaned: bool = False  # its caller was found dead (if it was running: aborted, metered)


@dataclass
class _Lookup:
    started_at: float  # event-loop time
    alive: asyncio.Task[bool]


class OrphanWatch:
    """The running requests of one replica by caller (module docstring)."""

    def __init__(
        self,
        abort: Callable[[str], None],
        usage_log: Callable[[], UsageLog | None],
        *,
        check_s: float = 0.5,
        hold_s: float = HOLD_S,
        confirm_s: float = 5.0,
        min_lookup_interval_s: float = 0.02,
        is_alive: Callable[[CallerRef], bool] = caller_alive,
    ) -> None:
        """`abort(request_id)` ends a request in the engine; `usage_log()` is where orphans'
        records go (None: not metered, e.g. no object store). The callers of running requests
        are looked up every `check_s`; a caller is looked up at most once per
        `min_lookup_interval_s`, one look-up shared by all who wait for it; a dead caller's
        streams end `hold_s` after its death was found; a stream `cut` by a caller found alive
        is metered if the caller is found dead within `confirm_s`."""
        self.abort, self.usage_log, self.is_alive = abort, usage_log, is_alive
        self.check_s, self.hold_s, self.min_lookup_interval_s = check_s, hold_s, min_lookup_interval_s
        self.confirm_s = confirm_s
        self._running: dict[str, _Running] = {}  # request id -> its caller and meter
        self._lookups: dict[str, _Lookup] = {}  # caller's actor name -> its latest look-up
        self._task: asyncio.Task[None] | None = None
        self._cut_checks: set[asyncio.Task[None]] = set()  # `cut`'s look-ups, held until done
        self.num_orphans = 0

    def start(self, request_id: str, tenant: str | None, caller: CallerRef) -> None:
        meter = None
        if caller.usage is not None and tenant is not None:
            tag = caller.usage
            meter = RequestMeter(request_id, tenant, tag.api_key_id, tag.model, tag.adapter)
        self._running[request_id] = _Running(caller, tenant, meter)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def streamed(self, request_id: str, output: RequestOutput) -> None:
        """`output` went to the caller (counted as delivered if the caller dies later)."""
        running = self._running.get(request_id)
        if running is not None and running.meter is not None:
            running.meter.see(output)

    async def settle(self, request_id: str) -> None:
        """Returns when the request's ended stream may close (module docstring): once a look-up
        of its caller begun after this call finds it alive, or `hold_s` after its caller was
        found dead. The request stays watched until `end`."""
        running = self._running.get(request_id)
        if running is None:
            return
        running.ended = True
        if not running.orphaned:
            if await self._alive_since(running.caller, asyncio.get_running_loop().time()):
                return
            running.orphaned = True
        await asyncio.sleep(self.hold_s)

    def cut(self, request_id: str) -> None:
        """The caller's side closed the request's stream before its end (the engine stops the
        request as the stream closes). A caller that lives does so when its client left, and
        meters the request itself; over gRPC (Serve's throughput-optimized mode) a caller's death
        closes the stream too, before any look-up finds it dead: so the request is metered here,
        `cancelled`, with what was streamed, if look-ups from now on find its caller dead within
        `confirm_s`."""
        running = self._running.get(request_id)
        if running is None or running.ended or running.orphaned:
            return
        running.ended = True  # its end is this look-up's, not `_watch`'s
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._meter_if_dead(running, loop.time()))
        self._cut_checks.add(task)
        task.add_done_callback(self._cut_checks.discard)

    def end(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    async def _meter_if_dead(self, running: _Running, cut_at: float) -> None:
        """A caller killed an instant before the cut may still be found by a look-up begun then
        (Ray's control store learns of a death a moment later), so it is taken for alive only
        once look-ups every `check_s` have found it so for `confirm_s` after the cut. A living
        caller that closed the stream and metered it itself, then dies within `confirm_s`, gets
        the request recorded a second time here, `cancelled` under the same request id: the
        usage API counts a request's cancelled records once (`usage_query.first_cancelled`)."""
        loop = asyncio.get_running_loop()
        since = cut_at
        while await self._alive_since(running.caller, since):
            if loop.time() - cut_at >= self.confirm_s:
                return
            await asyncio.sleep(self.check_s)
            since = loop.time()
        running.orphaned = True
        self._record_orphan(running)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running:
            await asyncio.sleep(self.check_s)
            now = loop.time()
            callers = {r.caller.actor_name: r.caller for r in self._running.values() if not r.orphaned}
            for name in [
                n for n, lookup in self._lookups.items() if n not in callers and lookup.alive.done()
            ]:
                del self._lookups[name]
            for name, caller in callers.items():
                if await self._alive_since(caller, now):
                    continue
                num_aborted = 0
                for request_id, running in list(self._running.items()):
                    if running.caller.actor_name != name:
                        continue
                    if not running.orphaned and not running.ended:
                        self._orphaned(request_id, running)
                        num_aborted += 1
                    running.orphaned = True
                if num_aborted:  # a caller with only ended streams: nothing to say beyond the hold
                    logger.warning(
                        "caller gone; its requests aborted", extra={"caller": name, "requests": num_aborted}
                    )

    async def _alive_since(self, caller: CallerRef, since: float) -> bool:
        """Whether `caller` lives, by a look-up begun at or after `since` (event-loop time)."""
        loop = asyncio.get_running_loop()
        while True:
            lookup = self._lookups.get(caller.actor_name)
            if lookup is not None:
                if lookup.started_at >= since:
                    return await asyncio.shield(lookup.alive)
                if not lookup.alive.done():
                    await asyncio.wait({lookup.alive})
                    continue
                wait_s = lookup.started_at + self.min_lookup_interval_s - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue
            started_at = loop.time()
            self._lookups[caller.actor_name] = _Lookup(started_at, loop.create_task(self._is_alive(caller)))

    async def _is_alive(self, caller: CallerRef) -> bool:
        """The look-up, off the event loop; one that fails (Ray's control store unreachable)
        takes the caller for alive: nothing is aborted on a guess."""
        try:
            return await asyncio.to_thread(self.is_alive, caller)
        except Exception as exc:  # noqa: BLE001 - unknown is not dead
            logger.warning(
                "caller look-up failed", extra={"caller": caller.actor_name, "error": str(exc)[:200]}
            )
            return True

    def _orphaned(self, request_id: str, running: _Running) -> None:
        self.abort(request_id)
        self._record_orphan(running)

    def _record_orphan(self, running: _Running) -> None:
        """Counted, and metered `cancelled` with what was streamed (a metered request's)."""
        self.num_orphans += 1
        log = self.usage_log()
        if running.meter is not None and log is not None:
            log.submit(running.meter.record("cancelled", "abort"))
