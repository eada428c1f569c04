"""The batch queue: a pointer object under `queue/` per batch not yet final (`queue_key`),
written when the batch is created and deleted when it ends."""

from __future__ import annotations

import json

from tandem.batch.records import QUEUE_PREFIX
from tandem.platform.object_store import ObjectNotFound, ObjectStore


class BatchQueue:
    """Reads the queue of `store`, remembering entries it read (an entry never changes while it
    exists: a listing costs one LIST and a GET per entry not seen before)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._entries: dict[str, tuple[str, str]] = {}  # queue key -> (tenant, batch id)

    def batches(self) -> list[tuple[str, str]]:
        """(tenant, batch_id) of every batch not yet final, oldest first."""
        out = []
        keys = self.store.list(QUEUE_PREFIX)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                try:
                    doc = json.loads(self.store.get(key).data)
                except ObjectNotFound:
                    continue
                entry = self._entries[key] = (doc["tenant"], doc["batch_id"])
            out.append(entry)
        listed = set(keys)
        self._entries = {k: v for k, v in self._entries.items() if k in listed}
        return out
