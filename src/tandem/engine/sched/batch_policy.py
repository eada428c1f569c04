"""How batch-priority requests fill idle capacity only (no torch).

A batch request is admitted while the KV cache, counting its whole prompt, stays under
`kv_occupancy_limit` (alone it always runs); each batch prefill chunk is capped at
`max_prefill_tokens`, so that a step holding interactive decodes stays short. While interactive
requests run or wait, batch requests share `tokens_under_load` tokens per step; for
`interactive_quiet_s` after the last of them left, at most `tokens_after_interactive` (a step in
flight is what a newly arrived interactive request waits for, and a full batch step is many times
a short one). A step that computes an interactive prompt chunk gives batch requests at most
`tokens_beside_interactive_prompt` (batch rows beside a prompt lengthen exactly the steps that make
up its time to first token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.kv.block_pool import BlockPool


@dataclass
class BatchPolicy:
    kv_occupancy_limit: float = 0.8
    max_prefill_tokens: int | None = None  # None: a quarter of the step's token budget
    tokens_under_load: int = 4
    tokens_after_interactive: int | None = None
    interactive_quiet_s: float = 2.0
    tokens_beside_interactive_prompt: int | None = None
    clock: Callable[[], float] = time.monotonic
    _last_interactive_at: float = field(default=float("-inf"), repr=False)

    def prefill_cap(self, max_num_batched_tokens: int) -> int:
        """Most tokens of one batch prefill chunk."""
        return self.max_prefill_tokens or max(1, max_num_batched_tokens // 4)

    def step_cap(self, interactive_active: bool) -> int | None:
        """Tokens batch requests share this step (None: the whole budget), given whether any
        interactive request runs or waits now."""
        now = self.clock()
        if interactive_active:
            self._last_interactive_at = now
            return self.tokens_under_load
        if (
            self.tokens_after_interactive is not None
            and now - self._last_interactive_at < self.interactive_quiet_s
        ):
            return self.tokens_after_interactive
        return None

    def cap_beside_prompt(self, cap: int | None) -> int | None:
        """`cap` for a step that computes an interactive prompt chunk."""
        beside = self.tokens_beside_interactive_prompt
        if beside is None:
            return cap
        return beside if cap is None else min(cap, beside)

    def has_room(self, pool: BlockPool, num_new_blocks: int) -> bool:
        """Whether a batch request needing `num_new_blocks` more of `pool` may be admitted."""
        if pool.num_used_blocks == 0:
            return True  # alone it always runs, however long its prompt
        return pool.num_used_blocks + num_new_blocks <= self.kv_occupancy_limit * pool.num_blocks
