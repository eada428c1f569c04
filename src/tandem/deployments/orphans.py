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


@dataclass
class _Running:
    caller: CallerRef
    tenant: str | None
    meter: RequestMeter | None = None


class OrphanWatch:
    """The running requests of one replica by caller (module docstring)."""

    def __init__(
        self,
        abort: Callable[[str], None],
        usage_log: Callable[[], UsageLog | None],
        *,
        check_s: float = 0.5,
        is_alive: Callable[[CallerRef], bool] = caller_alive,
    ) -> None:
        """`abort(request_id)` ends a request in the engine; `usage_log()` is where orphans'
        records go (None: not metered, e.g. no object store)."""
        self.abort, self.usage_log, self.check_s, self.is_alive = abort, usage_log, check_s, is_alive
        self._running: dict[str, _Running] = {}  # request id -> its caller and meter
        self._task: asyncio.Task[None] | None = None
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

    def end(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    async def _watch(self) -> None:
        while self._running:
            await asyncio.sleep(self.check_s)
            callers = {r.caller.actor_name: r.caller for r in self._running.values()}
            for name, caller in callers.items():
                if await asyncio.to_thread(self.is_alive, caller):
                    continue
                orphans = [rid for rid, r in self._running.items() if r.caller.actor_name == name]
                logger.warning(
                    "caller gone; its requests aborted", extra={"caller": name, "requests": len(orphans)}
                )
                for request_id in orphans:
                    self._orphaned(request_id)

    def _orphaned(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is None:
            return
        self.num_orphans += 1
        self.abort(request_id)
        log = self.usage_log()
        if running.meter is not None and log is not None:
            log.submit(running.meter.record("cancelled", "abort"))
