"""Arrays to operands, and new arrays of the caller's kind.

``door.operand`` is the one way any array becomes an ``Operand`` (descriptor, pointer,
device, kind); ``kinds`` is the one table new arrays are allocated from; ``operand.py`` holds
the rules for arrays written in place. BF16 comes as torch.bfloat16, through DLPack, or as
``ml_dtypes.bfloat16`` in NumPy and CuPy 14.
"""

from .door import Seen, common_place, operand, place, see
from .kinds import CUPY, NUMPY, TORCH
from .operand import Operand, check_written, shares_memory
from .torch_tensors import torch_stream

__all__ = [
    "CUPY",
    "NUMPY",
    "TORCH",
    "Operand",
    "Seen",
    "check_written",
    "common_place",
    "operand",
    "place",
    "see",
    "shares_memory",
    "torch_stream",
]
