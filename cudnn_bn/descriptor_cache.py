"""A bounded, thread-safe cache of per-problem plans keyed by everything they depend on.

Like PyTorch's cache of convolution parameters: the key holds the device, every tensor's
shape, strides and dtype, and the attributes (mode, eps); the value is a plan holding a built
operator descriptor, so a repeated call skips validation, cuDNN descriptor creation and size
queries.

A look-up takes no lock (one dict read: CPython's dict operations are atomic); only adding
an entry does. Eviction is CLOCK, the second-chance approximation of least-recently-used: a
hit sets the entry's ``used`` bit, and when the cache is full the oldest entries whose bit is
set are given another round (bit cleared, moved to the back) while the first one without it
is dropped (never the entry just added). Dropping an entry closes nothing at once: an entry
closes its descriptor when its last reference goes (``weakref.finalize``), so a call that
still holds an evicted entry finishes with it open, and when two threads build one key at
once the copy that is not kept is closed as soon as its builder drops it.
"""

import threading
import weakref
from collections.abc import Hashable
from typing import Any

DEFAULT_CAPACITY = 256


class DescriptorCache:
    """Entries (plans) by key, at most ``capacity`` of them (the one just added at least); an
    entry has a ``descriptor`` (closed with ``__exit__``) and gets a ``used`` bit."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        """The entry for ``key``, marked used; None on a miss."""
        found = self._entries.get(key)
        if found is not None:
            found.used = True
        return found

    def add(self, key: Hashable, entry: Any) -> Any:
        """Cache ``entry`` for ``key`` and return it, or the entry another thread added for
        ``key`` meanwhile. Either way ``entry``'s descriptor closes once ``entry`` is gone."""
        entry.used = False
        closing = weakref.finalize(entry, entry.descriptor.__exit__, None, None, None)
        closing.atexit = False  # at exit the libraries it would call may be gone
        with self._lock:
            found = self._entries.setdefault(key, entry)
            found.used = found is not entry
            while len(self._entries) > max(self.capacity, 1):  # never the one just added
                self._evict_one(key)
        return found

    def _evict_one(self, newest: Hashable) -> None:
        """Drop the oldest entry not used since its last chance, never ``newest`` (lock
        held)."""
        entries = self._entries
        for key in [k for k in entries if k is not newest]:
            entry = entries.pop(key)
            if not entry.used:
                return
            entry.used = False
            entries[key] = entry  # to the back
        del entries[next(k for k in entries if k is not newest)]  # all had their chance

    def clear(self) -> None:
        """Forget every entry; each closes once no call holds it."""
        with self._lock:
            self._entries = {}

    def descriptors(self) -> list[Any]:
        """The descriptors of the cached entries, oldest first."""
        return [entry.descriptor for entry in list(self._entries.values())]

    def __len__(self) -> int:
        return len(self._entries)
