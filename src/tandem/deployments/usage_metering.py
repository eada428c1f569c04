"""`RequestMeter`: counts one real-time request's usage as its outputs pass, then makes its record.

The ingress meters a real-time request from the moment the engine takes it; batch lines are
metered by the batch worker when their shard commits (batch/usage.py), so a line that runs twice
is counted once. Statuses: `completed` (the response reported its usage), `cancelled` (the client
went away, or the server drained: the tokens sent until then), `failed` (the engine or the server
failed it; recorded, not billed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.engine.protocol import RequestOutput
from tandem.platform.usage_records import UsageRecord, UsageStatus


@dataclass
class RequestMeter:
    request_id: str
    tenant: str
    api_key_id: str | None
    model: str  # as the client named it
    adapter: str | None
    started_at: float = field(default_factory=time.time)  # epoch seconds
    started: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    choice_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens seen
    recorded: bool = False

    def see(self, out: RequestOutput) -> None:
        """Count `out`: a final output (or a choice that ended) is whole, a running one a delta."""
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = out.metrics.num_cached_tokens
        self.num_accepted_draft_tokens = out.metrics.num_accepted_draft_tokens
        for choice in out.outputs:
            if out.finished or choice.finish_reason is not None:
                self.choice_tokens[choice.index] = len(choice.token_ids)
            else:
                self.choice_tokens[choice.index] = self.choice_tokens.get(choice.index, 0) + len(
                    choice.delta_token_ids
                )

    @property
    def num_output_tokens(self) -> int:
        return sum(self.choice_tokens.values())

    def record(self, status: UsageStatus, finish_reason: str | None) -> UsageRecord:
        """The request's record (once: `recorded` is set)."""
        self.recorded = True
        return UsageRecord(
            request_id=self.request_id,
            tenant=self.tenant,
            api_key_id=self.api_key_id,
            model=self.model,
            adapter=self.adapter,
            input_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached_tokens,
            output_tokens=self.num_output_tokens,
            accepted_draft_tokens=self.num_accepted_draft_tokens,
            status=status,
            finish_reason=finish_reason,
            priority="interactive",
            batch_id=None,
            started_at=self.started_at,
            finished_at=time.time(),
            latency_s=time.monotonic() - self.started,
        )
