"""BF16 <-> float32 bit conversions for the tests' references, stored as ``uint16``.

The CPU engine converts inside its kernels (``cudnn_bn/backends/cpu_kernels.py``).

A BF16 value is the upper half of a float32: reading shifts the bits up by 16, writing
rounds the float32 bits to nearest, ties to even (as PyTorch and CUDA's ``__float2bfloat16``
do), and keeps NaN a NaN by setting the quiet bit.
"""

import numpy as np


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of BF16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """BF16 bit patterns of float32 values, rounded to nearest even; NaN stays NaN."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)  # 64 bits: the rounding add cannot wrap
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x0040  # a signalling NaN's payload may sit in the low half
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)
