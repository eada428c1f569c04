"""Time-limited leases on the object store, taken and renewed by compare-and-swap.

A lease object holds its owner and an expiry (wall-clock seconds, shared by every host). Taking a
lease is a put-if-absent (no lease yet) or a compare-and-swap on the etag of an expired one, so
of two workers racing for it exactly one wins. Renewal is a compare-and-swap on the etag the owner
last wrote: if someone else took the lease meanwhile (ours expired), renewal fails and the owner
must stop. A crashed owner simply stops renewing; its lease expires and the work is taken again.

A store outage stops every owner's renewals alike: an expired lease is not taken while the store
has answered for less than a renewal period (`ObjectStore.healthy_for_s`), so each live owner
renews first (its compare-and-swap still holds: nobody wrote the lease meanwhile) and an outage
does not hand every shard in flight to another worker.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

from tandem.platform.object_store import ObjectNotFound, ObjectStore, PreconditionFailed


@dataclass
class Lease:
    key: str
    owner: str
    etag: str
    expires_at: float


def _payload(owner: str, expires_at: float) -> bytes:
    # claimed_at makes every write's bytes (and so its etag) unique, even for the same owner.
    return json.dumps({"owner": owner, "expires_at": expires_at, "written_at": time.time()}).encode()


class LeaseManager:
    def __init__(self, store: ObjectStore, owner: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("lease ttl_s must be > 0")
        self.store = store
        self.owner = owner
        self.ttl_s = ttl_s

    @property
    def renew_every_s(self) -> float:
        """How often an owner renews (a third of the ttl: two renewals may fail in a row)."""
        return self.ttl_s / 3

    def try_claim(self, key: str) -> Lease | None:
        """Take the lease at `key` if nobody holds a live one; None when someone does."""
        try:
            current = self.store.get(key)
        except ObjectNotFound:
            current = None
        if current is not None and json.loads(current.data)["expires_at"] > time.time():
            return None
        if current is not None and self.store.healthy_for_s() < self.renew_every_s + 1.0:
            return None  # the store just came back: its owner renews first, if it lives
        expires_at = time.time() + self.ttl_s
        try:
            etag = self.store.put(
                key,
                _payload(self.owner, expires_at),
                if_none_match=current is None,
                if_match=None if current is None else current.etag,
            )
        except PreconditionFailed:
            return None  # another worker won the race
        return Lease(key, self.owner, etag, expires_at)

    def renew(self, lease: Lease) -> bool:
        """Extend `lease`; False when it was lost (expired and taken by someone else)."""
        expires_at = time.time() + self.ttl_s
        try:
            lease.etag = self.store.put(lease.key, _payload(self.owner, expires_at), if_match=lease.etag)
        except PreconditionFailed:
            return False
        lease.expires_at = expires_at
        return True

    def release(self, lease: Lease) -> None:
        """Mark `lease` expired (if we still hold it) so others need not wait for the timeout."""
        with contextlib.suppress(PreconditionFailed):
            self.store.put(lease.key, _payload(self.owner, 0.0), if_match=lease.etag)

    def is_live(self, key: str) -> bool:
        try:
            return bool(json.loads(self.store.get(key).data)["expires_at"] > time.time())
        except ObjectNotFound:
            return False
