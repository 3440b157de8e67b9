"""Generations of the cache's milvus-lite collection, and the gate that switches between them.

milvus-lite 2.5.1 keeps every row the cache deletes (evictions, invalidations, expiry) in its
server's memory and has no compaction (`compact` is UNIMPLEMENTED), nor aliases or renames. So
the store reclaims that memory itself: it copies the live rows into a fresh collection, the
next generation, and drops the old one. Dropping the old generation is the commit: until then
it holds every acknowledged write, so a store opened after a crash at any step takes the
lowest generation it finds and drops the unfinished copies above it.

Generation 0 is the plain collection name (what earlier versions created); generation n is
`<name>_g<n>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator

CATCH_UP_ROUNDS = 4  # replays of recorded writes before the switch, while calls go on
HELD_REPLAY_MAX = 4  # catching up stops once a round has this few: the switch replays the rest
# Rows the journal records before the cache's stores wait for the reclaim (`Gate.full`): a copy
# under a stream of new stores ran 110 s for 97,000 rows on 2 cores (30 s idle), and its
# journal had grown the cache process by 1.6 GiB. A recorded store is about 1 KiB (its entry;
# its vector besides when it is a semantic one), so this holds it to tens of MiB; the stores
# waiting meanwhile stay readable, and past HOPLINE_CACHE_MAX_PENDING new ones are refused.
JOURNAL_MAX_ROWS = 50_000


def generation_name(base: str, n: int) -> str:
    return base if n == 0 else f"{base}_g{n}"


def generation_of(base: str, name: str) -> int | None:
    """The generation `name` is of `base`'s collection, None when it is another collection."""
    if name == base:
        return 0
    prefix = f"{base}_g"
    suffix = name[len(prefix) :]
    if name.startswith(prefix) and suffix.isdigit() and not suffix.startswith("0"):
        return int(suffix)
    return None


def current_and_abandoned(base: str, names: Iterable[str]) -> tuple[str, list[str]]:
    """The generation to open and the unfinished copies above it (to drop)."""
    found = sorted((n, name) for name in names if (n := generation_of(base, name)) is not None)
    if not found:
        return base, []
    return found[0][1], [name for _, name in found[1:]]


# A write as it can be applied again to another collection; returns the rows it removed.
Write = Callable[[str], int]


@dataclasses.dataclass(frozen=True)
class Reclaimed:
    """One reclaim: what it copied and freed, and how long the store was held still."""

    collection: str  # the new generation
    copied: int  # live rows copied
    freed: int  # deleted rows the old generation still held (counted since the store opened)
    replayed: int  # writes that landed during the copy and were applied to the copy
    seconds: float  # the whole reclaim
    switch_ms: float  # the part during which no call could run


class Gate:
    """Calls run side by side; a switch waits for the running ones and holds new ones back.

    While a journal is open, every write that passes the gate is recorded, so a copy started
    after the journal opened can be brought up to date before the switch.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._held = False
        self._journal: list[Write] | None = None
        self._journal_rows = 0  # rows the writes in `_journal` carry

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self._cond:
            while self._held:
                self._cond.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    def record(self, write: Write, rows: int = 1) -> None:
        """Called inside `call()`, after the write of `rows` rows succeeded."""
        with self._cond:
            if self._journal is not None:
                self._journal.append(write)
                self._journal_rows += rows

    def full(self) -> bool:
        """Whether the open journal holds JOURNAL_MAX_ROWS rows: new stores should wait for the
        reclaim (deletes still go: an invalidation must not wait for a copy)."""
        return self._journal_rows >= JOURNAL_MAX_ROWS

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No call runs inside this block."""
        with self._cond:
            while self._held:
                self._cond.wait()
            self._held = True
            while self._running:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def open_journal(self) -> None:
        # Held, so no write is half way: each one either landed before or will be recorded.
        with self.held():
            self._journal = []

    def take_journal(self) -> list[Write]:
        """The writes recorded so far; recording goes on into a fresh journal."""
        with self._cond:
            taken, self._journal = self._journal or [], ([] if self._journal is not None else None)
            self._journal_rows = 0
        return taken

    def close_journal(self) -> list[Write]:
        """Call while held: the last writes recorded; recording stops."""
        with self._cond:
            taken, self._journal = self._journal or [], None
            self._journal_rows = 0
        return taken
