"""Why `AsyncEngine.from_options` loads the model in its engine thread: the same engine, the same
requests, run from the thread that loaded it and then from a second thread, in one process.

torch's CPU kernels run in OpenMP teams, one per calling thread; on a 2-core host, once a second
thread has its own team, a thread's kernels run about 2x slower (measured here, and for a single
bfloat16 linear in docs/performance.md).

    python benchmarks/engine_threads.py        # -> benchmarks/results/engine_threads.json
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from common import log, write_result
from tandem import LLM, SamplingParams

TOPICS = ["the ocean", "a city at night", "old trains", "mountain weather", "bread baking", "chess openings"]


def main() -> None:
    llm = LLM()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [
        [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]} (note {i})."}]
        for i in range(256)
    ]
    runs: dict[str, Any] = {}

    def run(tag: str) -> None:
        before = llm.stats()
        started = time.perf_counter()
        outs = llm.chat(prompts, params)
        wall = time.perf_counter() - started
        after = llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs[tag] = {
            "tokens_per_s": tokens / wall,
            "num_steps": after["num_steps"] - before["num_steps"],
            "step_wall_s": after["step_wall_s"] - before["step_wall_s"],
        }
        log(f"{tag}: {tokens / wall:.1f} tok/s")

    run("loading_thread")
    other = threading.Thread(target=run, args=("second_thread",))
    other.start()
    other.join()
    runs["ratio_second_over_loading"] = (
        runs["second_thread"]["tokens_per_s"] / runs["loading_thread"]["tokens_per_s"]
    )
    write_result(Path(__file__).parent / "results" / "engine_threads.json", runs)


if __name__ == "__main__":
    main()
