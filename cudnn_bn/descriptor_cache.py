"""A bounded, thread-safe cache of operator descriptors keyed by everything they depend on.

Like PyTorch's cache of convolution parameters: the key holds the device, every tensor's
shape, strides and dtype, and the attributes (mode, eps); the value is a built descriptor, so
a repeated call skips validation, cuDNN descriptor creation and size queries. The least
recently used entry is closed when the cache is full.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_CAPACITY = 256


class DescriptorCache:
    """Least-recently-used descriptors; evicted ones are closed (``__exit__``)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The descriptor for ``key``, built by ``build()`` on a miss."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        built = build()
        with self._lock:
            self._entries[key] = built
            while len(self._entries) > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                evicted.__exit__(None, None, None)
        return built

    def clear(self) -> None:
        """Close and forget every cached descriptor."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            entry.__exit__(None, None, None)

    def __len__(self) -> int:
        return len(self._entries)
