"""``Owned``: a native cuDNN object whose lifetime a Python object owns.

``close()`` destroys it (twice is a no-op), a ``with`` block closes it, and garbage
collection closes it through a ``weakref.finalize`` that holds only the destroy function and
the raw pointer, never ``self``. After close the object is dead: passing it to cuDNN raises
``BadParamError`` instead of handing cuDNN a dangling pointer. Nothing is destroyed at
interpreter exit, when the CUDA context may already be gone (PyTorch leaks handles likewise).
"""

import ctypes
import weakref
from collections.abc import Callable
from typing import Any, Self

from ..enums import Status
from ..errors import InfiniError


class Owned:
    """Base for cuDNN handles and descriptors: ``_as_parameter_`` is the live pointer."""

    def __init__(self, ref: Any, destroy: Callable[[Any], Any]) -> None:
        self._ref = ref
        self._finalizer = weakref.finalize(self, destroy, ref)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def ref(self) -> Any:
        """The raw ctypes pointer, for argument lists built once; BAD_PARAM once closed."""
        if not self._finalizer.alive:
            raise InfiniError(Status.BAD_PARAM, f"{type(self).__name__} used after close()")
        return self._ref

    _as_parameter_ = ref

    def close(self) -> None:
        """Destroy the native object now; later uses raise ``BadParamError``."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else hex(ctypes.cast(self._ref, ctypes.c_void_p).value or 0)
        return f"<{type(self).__name__} {state}>"
