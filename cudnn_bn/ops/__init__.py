"""Operators: validation, the descriptor with its cached sizes, dispatch to a backend."""
