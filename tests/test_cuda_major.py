"""The libcudnn loaded is the installed cuDNN wheel's, whichever CUDA major it is built for.

``make test`` runs this in the main environment (``nvidia-cudnn-cu12``) and, with the other
tests of the ctypes layer, in ``.venv-cu13`` (``nvidia-cudnn-cu13``): the same package must
find, load and describe either wheel's library with no GPU.
"""

import contextlib
from importlib import metadata
from pathlib import Path

import pytest

import cudnn_bn

WHEELS = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")


def _installed() -> list[metadata.Distribution]:
    found = []
    for name in WHEELS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(metadata.distribution(name))
    return found


def test_loads_the_installed_wheels_libcudnn():
    wheels = _installed()
    if len(wheels) != 1:
        pytest.skip(f"needs exactly one of {WHEELS} installed, found {len(wheels)}")
    wheel = wheels[0]
    info = cudnn_bn.cudnn_info()
    files = {Path(wheel.locate_file(f)).resolve() for f in wheel.files or ()}
    assert Path(info.path).resolve() in files, (info.path, wheel.metadata["Name"])
    assert info.found_via == "wheel"
    major, minor, patch = (int(p) for p in wheel.version.split(".")[:3])
    assert info.version == major * 10000 + minor * 100 + patch
