"""Backends of the operators: NumPy on host pointers (``cpu``) and cuDNN on device pointers."""
