"""A bounded, thread-safe cache of operator descriptors keyed by everything they depend on.

Like PyTorch's cache of convolution parameters: the key holds the device, every tensor's
shape, strides and dtype, and the attributes (mode, eps); the value is a built descriptor, so
a repeated call skips validation, cuDNN descriptor creation and size queries. The least
recently used entry is evicted when the cache is full.

A descriptor is used under a lease (``with cache.lease(key, build) as descriptor:``). An
evicted descriptor is closed (``__exit__``) only once no lease holds it, so eviction by one
thread never closes cuDNN state that another thread's call is using; and when two threads
build the same key at once, the second one's copy is closed and the first one's shared.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_CAPACITY = 256


class _Lease:
    """``with cache.lease(key, build) as descriptor:`` (a class, not a generator: a lease is
    taken on every array-API call)."""

    __slots__ = ("build", "cache", "held", "key")

    def __init__(self, cache: "DescriptorCache", key: Hashable, build: Callable[[], Any]) -> None:
        self.cache, self.key, self.build = cache, key, build

    def __enter__(self) -> Any:
        self.held = self.cache._acquire(self.key, self.build)
        return self.held

    def __exit__(self, *exc_info: object) -> None:
        self.cache._release(self.held)


class DescriptorCache:
    """Least-recently-used descriptors, closed when evicted and no longer leased."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._leases: dict[int, int] = {}  # id(descriptor) -> calls using it now
        self._evicted: dict[int, Any] = {}  # leased descriptors to close on last release
        self._lock = threading.Lock()

    def lease(self, key: Hashable, build: Callable[[], Any]) -> "_Lease":
        """The descriptor for ``key`` (built by ``build()`` on a miss), kept open while the
        ``with`` block runs."""
        return _Lease(self, key, build)

    def _acquire(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return self._hold(found)
        built = build()
        with self._lock:
            found = self._entries.get(key)
            if found is None:  # else another thread built it meanwhile: share that one
                self._entries[key] = found = built
                built = None
            held = self._hold(found)
            to_close = self._evict()
        for descriptor in (*to_close, built):
            if descriptor is not None:
                descriptor.__exit__(None, None, None)
        return held

    def _hold(self, descriptor: Any) -> Any:
        self._leases[id(descriptor)] = self._leases.get(id(descriptor), 0) + 1
        return descriptor

    def _evict(self) -> list[Any]:
        """Drop entries beyond capacity; returns those free to close now (lock held)."""
        free = []
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            free.extend(self._retire(evicted))
        return free

    def _retire(self, descriptor: Any) -> list[Any]:
        if self._leases.get(id(descriptor)):
            self._evicted[id(descriptor)] = descriptor
            return []
        return [descriptor]

    def _release(self, descriptor: Any) -> None:
        with self._lock:
            count = self._leases.pop(id(descriptor)) - 1
            if count:
                self._leases[id(descriptor)] = count
                return
            closing = self._evicted.pop(id(descriptor), None)
        if closing is not None:
            closing.__exit__(None, None, None)

    def clear(self) -> None:
        """Forget every cached descriptor; each is closed once no lease holds it."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
            free = [d for entry in entries for d in self._retire(entry)]
        for descriptor in free:
            descriptor.__exit__(None, None, None)

    def descriptors(self) -> list[Any]:
        """The operator descriptors of the cached plans, least recently used first."""
        with self._lock:
            return [plan.descriptor for plan in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)
