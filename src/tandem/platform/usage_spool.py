"""The local write-ahead spool of usage records: durable on this machine's disk before a response
reports its usage, shipped to the object store in the background.

Layout, one directory per object store (`spool_dir`), one writer (process) at a time per file:

- `<writer>.lock`: held with an exclusive `flock` for the writer's life. A lock that can be taken
  belongs to a process that died: its spool is an orphan, and any writer of the same store on
  this machine ships it (`sweep_orphans`), the next process of the same replica included.
- `<writer>-<gen>.wal`: records as JSON lines, appended and fsync'd (`SpoolWriter.append`); a new
  segment (`gen` + 1) once one passes `rotate_bytes`, the old one deleted once shipped.
- `<writer>-<gen>.ship`: how far the segment is shipped, and the range being shipped now.

Exactly once: before a range of a segment is written to the store, its bounds are written to the
`.ship` file; every object of that range has a key made of the segment and the range's start
(`realtime_key(hour, "<writer>-<gen>", start)`), written put-if-absent. A process that dies
mid-ship leaves the bounds; whoever ships the segment next ships the same range under the same
keys, and a key found taken means the earlier try landed. A torn last line (a crash mid-append,
never acknowledged) is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tandem.platform.object_store import ObjectStore, PreconditionFailed
from tandem.platform.usage_records import UsageRecord, by_hour, encode_records, realtime_key

logger = logging.getLogger("tandem.usage")

SEGMENT_SUFFIX = ".wal"
SHIP_SUFFIX = ".ship"
LOCK_SUFFIX = ".lock"


def _fsync_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Segment:
    """One `.wal` file and its `.ship` progress (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ship_path = path.with_suffix(SHIP_SUFFIX)
        self.name = path.stem  # "<writer>-<gen>": the writer part of its objects' keys

    @property
    def gen(self) -> int:
        return int(self.name.rsplit("-", 1)[1])

    def _progress(self) -> tuple[int, tuple[int, int] | None]:
        try:
            state = json.loads(self.ship_path.read_bytes())
        except FileNotFoundError:
            return 0, None
        shipping = state.get("shipping")
        return int(state["shipped"]), (int(shipping[0]), int(shipping[1])) if shipping else None

    def _set_progress(self, shipped: int, shipping: tuple[int, int] | None) -> None:
        _fsync_write(self.ship_path, json.dumps({"shipped": shipped, "shipping": shipping}).encode())

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def fully_shipped(self) -> bool:
        shipped, shipping = self._progress()
        return shipping is None and shipped >= self.size()

    def ship(
        self,
        store: ObjectStore,
        max_records: int,
        on_shipped: Callable[[list[UsageRecord]], None] | None = None,
    ) -> int:
        """Ship every complete line not shipped yet, `max_records` per range; returns how many
        records. Raises the store's error (the progress made so far is kept)."""
        shipped, shipping = self._progress()
        total = 0
        if shipping is not None:  # a range begun by a process that stopped: the same keys again
            total += self._ship_range(store, *shipping, on_shipped)
            shipped = shipping[1]
            self._set_progress(shipped, None)
        while True:
            end, records = self._read_from(shipped, max_records)
            if not records:
                return total
            self._set_progress(shipped, (shipped, end))
            total += self._ship_range(store, shipped, end, on_shipped, records)
            shipped = end
            self._set_progress(shipped, None)

    def _read_from(self, start: int, max_records: int) -> tuple[int, list[UsageRecord]]:
        """Up to `max_records` complete lines from byte `start`: (end offset, records)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return start, []
        records: list[UsageRecord] = []
        offset = start
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n") or len(records) >= max_records:
                break  # a torn last line: never acknowledged
            offset += len(line)
            with contextlib.suppress(ValueError, TypeError):
                records.append(UsageRecord(**json.loads(line)))
        return offset, records

    def _ship_range(
        self,
        store: ObjectStore,
        start: int,
        end: int,
        on_shipped: Callable[[list[UsageRecord]], None] | None,
        records: list[UsageRecord] | None = None,
    ) -> int:
        if records is None:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            records = []
            for line in data.splitlines():
                with contextlib.suppress(ValueError, TypeError):
                    records.append(UsageRecord(**json.loads(line)))
        for hour, group in by_hour(records).items():
            with contextlib.suppress(PreconditionFailed):  # found taken: an earlier try of this range landed
                store.put(realtime_key(hour, self.name, start), encode_records(group), if_none_match=True)
        if on_shipped is not None and records:
            on_shipped(records)
        return len(records)

    def remove(self) -> None:
        for path in (self.path, self.ship_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _segments(spool_dir: Path, writer: str) -> list[Segment]:
    """The writer's segments, oldest first."""
    found = [Segment(p) for p in spool_dir.glob(f"{writer}-*{SEGMENT_SUFFIX}")]
    return sorted((s for s in found if s.name.rsplit("-", 1)[0] == writer), key=lambda s: s.gen)


class SpoolWriter:
    """One process's spool: appends (one thread at a time) and ships its own segments."""

    def __init__(self, spool_dir: Path, writer_id: str, *, rotate_bytes: int = 4 << 20) -> None:
        self.spool_dir = spool_dir
        self.writer_id = writer_id
        self.rotate_bytes = rotate_bytes
        spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_file = open(spool_dir / f"{writer_id}{LOCK_SUFFIX}", "a")  # noqa: SIM115 - held for life
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._gen = 0
        self._file = open(self._segment_path(0), "ab")  # noqa: SIM115 - the open segment

    def _segment_path(self, gen: int) -> Path:
        return self.spool_dir / f"{self.writer_id}-{gen:06d}{SEGMENT_SUFFIX}"

    def append(self, records: list[UsageRecord]) -> None:
        """Write `records` durably (one write, one fsync). Raises `OSError` (a full disk)."""
        data = b"".join(json.dumps(asdict(r), separators=(",", ":")).encode() + b"\n" for r in records)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._file.tell() >= self.rotate_bytes:
            self._file.close()
            self._gen += 1
            self._file = open(self._segment_path(self._gen), "ab")  # noqa: SIM115

    def ship(
        self,
        store: ObjectStore,
        max_records: int,
        on_shipped: Callable[[list[UsageRecord]], None] | None = None,
    ) -> int:
        """Ship this writer's unshipped records; rotated segments are deleted once shipped."""
        total = 0
        for segment in _segments(self.spool_dir, self.writer_id):
            total += segment.ship(store, max_records, on_shipped)
            if segment.gen < self._gen:
                segment.remove()
        return total

    def close(self) -> None:
        """Stop writing. A spool with nothing left unshipped is removed; else the lock is let go
        and the spool is an orphan that the next writer of this store ships."""
        self._file.close()
        segments = _segments(self.spool_dir, self.writer_id)
        if all(s.fully_shipped() for s in segments):
            for segment in segments:
                segment.remove()
            with contextlib.suppress(FileNotFoundError):
                (self.spool_dir / f"{self.writer_id}{LOCK_SUFFIX}").unlink()
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()


def sweep_orphans(
    store: ObjectStore,
    spool_dir: Path,
    *,
    exclude: str,
    max_records: int,
    on_shipped: Callable[[list[UsageRecord]], None] | None = None,
) -> int:
    """Ship and remove the spools of writers that died (their lock can be taken); returns how many
    records. Raises the store's error (what was shipped stays shipped)."""
    total = 0
    if not spool_dir.is_dir():
        return 0
    for lock_path in sorted(spool_dir.glob(f"*{LOCK_SUFFIX}")):
        writer = lock_path.name.removesuffix(LOCK_SUFFIX)
        if writer == exclude:
            continue
        try:
            lock_file = open(lock_path, "a")  # noqa: SIM115
        except FileNotFoundError:
            continue
        with lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer lives
            if not lock_path.exists():
                continue  # another sweeper finished it between our open and our lock
            num_records = 0
            for segment in _segments(spool_dir, writer):
                num_records += segment.ship(store, max_records, on_shipped)
                segment.remove()
            lock_path.unlink()
            total += num_records
            if num_records:
                logger.info(
                    "usage records of a stopped process shipped",
                    extra={"writer": writer, "num_records": num_records},
                )
    return total
