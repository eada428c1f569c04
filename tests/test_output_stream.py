"""`Mailbox`, the hand-over of a request's outputs from the engine's loop thread to its consumer's
event loop: order, waking a waiting consumer from another thread, and a cancelled wait."""

from __future__ import annotations

import asyncio
import threading

from tandem.engine.io.output_stream import Mailbox


def test_mailbox_keeps_order_and_wakes_its_consumer_from_another_thread() -> None:
    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        mailbox = Mailbox()
        mailbox.put_nowait(ValueError("first"))  # queued before anyone waits
        got: list[object] = [await mailbox.get()]
        assert mailbox.empty()

        def producer() -> None:  # as `AsyncEngine._deliver` does, from its loop thread
            for i in range(3):
                loop.call_soon_threadsafe(mailbox.put_nowait, KeyError(i))

        thread = threading.Thread(target=producer)
        waiting = asyncio.ensure_future(mailbox.get())  # waits: nothing is queued
        await asyncio.sleep(0)
        assert not waiting.done()
        thread.start()
        got.append(await asyncio.wait_for(waiting, timeout=30))
        thread.join()
        got += [await asyncio.wait_for(mailbox.get(), timeout=30) for _ in range(2)]
        return got

    got = asyncio.run(main())
    assert [str(e) for e in got] == ["first", "0", "1", "2"]


def test_a_cancelled_wait_leaves_the_mailbox_usable() -> None:
    async def main() -> object:
        mailbox = Mailbox()
        waiting = asyncio.ensure_future(mailbox.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled()
        mailbox.put_nowait(ValueError("after"))  # no waiter to wake: kept for the next get
        assert not mailbox.empty()
        return await asyncio.wait_for(mailbox.get(), timeout=30)

    assert str(asyncio.run(main())) == "after"
