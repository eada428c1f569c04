"""`StatsBoard`: the engine figures of every LLM replica, for the ingress's one `/metrics`.

A deployment handle reaches some replica, not each one, so the replicas report instead: each
sends its engine stats here whenever Serve collects its routing stats (`stats_period_s`), and
the ingress reads them all at once. A replica that stops reporting (it died, or was scaled down)
drops out after `ttl_s`. One board replica per application; it holds no other state, so a
restarted board is complete again after one reporting period.
"""

from __future__ import annotations

import time
from typing import Any

# The Serve deployment name of the board.
STATS_BOARD_DEPLOYMENT = "StatsBoard"


class StatsBoard:
    def __init__(self, ttl_s: float = 10.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (when, stats)

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        self._reports[replica_id] = (time.monotonic(), stats)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Replica id -> its latest stats, for replicas that reported within `ttl_s`."""
        cutoff = time.monotonic() - self.ttl_s
        for replica_id in [rid for rid, (when, _) in self._reports.items() if when < cutoff]:
            del self._reports[replica_id]
        return {rid: stats for rid, (_, stats) in self._reports.items()}
