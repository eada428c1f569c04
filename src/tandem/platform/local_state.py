"""What a process keeps on its machine's disk about one object store: state, not a cache (the
usage spool, the last tenant directory read). Under `$TANDEM_STATE_DIR` (default
`~/.local/state/tandem`), one folder per kind, named by a hash of the store's URL, so every
process of one store on a machine finds the same place."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("tandem.state")


def state_path(kind: str, store_url: str, suffix: str = "") -> Path:
    """`$TANDEM_STATE_DIR/<kind>/<hash of store_url><suffix>`."""
    root = os.environ.get("TANDEM_STATE_DIR") or str(Path.home() / ".local" / "state" / "tandem")
    return Path(root) / kind / (hashlib.sha256(store_url.encode()).hexdigest()[:16] + suffix)


class SavedDocument:
    """One document and its etag in a file of mode 0600, replaced atomically (a reader sees the
    old or the new copy). Best effort: a failed save is logged and only loses the copy."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> tuple[bytes, str | None] | None:
        """(document, etag) as last saved, or None (never saved, or unreadable)."""
        try:
            saved = json.loads(self.path.read_bytes())
            return saved["document"].encode(), saved["etag"]
        except (OSError, ValueError, KeyError):
            return None

    def save(self, document: bytes, etag: str | None) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps({"etag": etag, "document": document.decode()}).encode())
            os.replace(tmp, self.path)
        except OSError:
            logger.warning("could not save a local copy", exc_info=True, extra={"path": str(self.path)})
