"""A request over its tenant's concurrency limit waits its turn (FIFO per tenant) instead of a
429 at once; other tenants never wait for it; the 429 comes when no slot frees in time."""

from __future__ import annotations

import asyncio

import pytest

from tandem.deployments.openai.limiter import LocalTenantLimiter
from tandem.platform.api_keys import parse_keys
from tandem.platform.tenancy import RateLimitError, TenantLimits, TenantRegistry


def registry(**limits: int) -> TenantRegistry:
    return TenantRegistry(parse_keys("ka=a,kb=b"), TenantLimits(**limits))


def test_excess_requests_wait_their_turn_in_order() -> None:
    async def scenario() -> list[str]:
        limiter = LocalTenantLimiter(registry(max_concurrent_requests=1), max_wait_s=30.0)
        await limiter.acquire("a")
        admitted: list[str] = []

        async def request(name: str) -> None:
            await limiter.acquire("a")
            admitted.append(name)

        waiting = [asyncio.ensure_future(request(f"a{i}")) for i in range(3)]
        await asyncio.sleep(0)  # all three queued behind the first
        await limiter.acquire("b")  # another tenant is not held up by a's queue
        admitted.append("b")
        for _ in range(3):
            num_admitted = len(admitted)
            limiter.release("a", 0)
            await asyncio.wait_for(_grown(admitted, num_admitted), 5)
        await asyncio.gather(*waiting)
        return admitted

    assert asyncio.run(scenario()) == ["b", "a0", "a1", "a2"]


async def _grown(items: list[str], size: int) -> None:
    """Return once `items` holds more than `size` entries (a waiter was admitted)."""
    while len(items) <= size:
        await asyncio.sleep(0.001)


def test_the_429_comes_when_no_slot_frees_in_time_and_the_queue_moves_on() -> None:
    async def scenario() -> None:
        limiter = LocalTenantLimiter(registry(max_concurrent_requests=1), max_wait_s=0.2)
        await limiter.acquire("a")
        with pytest.raises(RateLimitError) as refused:
            await limiter.acquire("a")
        assert refused.value.status_code == 429 and refused.value.retry_after_s == 1.0
        assert not limiter._waiters  # nobody left in line
        limiter.release("a", 0)
        await limiter.acquire("a")  # the slot is free again

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_line_and_the_next_one_gets_the_slot() -> None:
    async def scenario() -> None:
        limiter = LocalTenantLimiter(registry(max_concurrent_requests=1), max_wait_s=30.0)
        await limiter.acquire("a")
        first = asyncio.ensure_future(limiter.acquire("a"))
        second = asyncio.ensure_future(limiter.acquire("a"))
        await asyncio.sleep(0)
        first.cancel()  # its client went away
        await asyncio.gather(first, return_exceptions=True)
        limiter.release("a", 0)
        await asyncio.wait_for(second, 5)

    asyncio.run(scenario())


def test_token_rate_refusals_are_immediate_and_no_wait_means_no_wait() -> None:
    async def scenario() -> None:
        limiter = LocalTenantLimiter(registry(tokens_per_minute=10), max_wait_s=30.0)
        await limiter.acquire("a")
        limiter.release("a", 50)
        with pytest.raises(RateLimitError) as refused:
            await asyncio.wait_for(limiter.acquire("a"), 1.0)
        assert refused.value.code == "tokens_per_minute_exceeded"
        immediate = LocalTenantLimiter(registry(max_concurrent_requests=1))
        await immediate.acquire("a")
        with pytest.raises(RateLimitError):
            await asyncio.wait_for(immediate.acquire("a"), 1.0)

    asyncio.run(scenario())
