"""The ctypes layer: libcudnn, its prototypes and enums, status mapping, owned objects."""
