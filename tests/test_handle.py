"""cuDNN handles without a GPU: creation fails with cuDNN's own status and strings."""

import pytest
from helpers import gpu_present

from cudnn_bn._cudnn import handle as handles
from cudnn_bn._cudnn.handle import Handle
from cudnn_bn.errors import DeviceNotInitializedError


@pytest.fixture(autouse=True)
def _no_gpu():
    if gpu_present():
        pytest.skip("a GPU is present, so cudnnCreate succeeds")


def _assert_not_initialized(error: DeviceNotInitializedError) -> None:
    message = str(error)
    assert "cudnnCreate" in message
    assert "CUDNN_STATUS_NOT_INITIALIZED (1001)" in message


def test_handle_without_driver():
    with pytest.raises(DeviceNotInitializedError) as caught:
        Handle()
    _assert_not_initialized(caught.value)


def test_pooled_handle_without_driver_fails_every_time(monkeypatch):
    monkeypatch.setattr(handles, "_free", {})
    for _ in range(2):
        with pytest.raises(DeviceNotInitializedError) as caught:
            handles.reserve(0)
        _assert_not_initialized(caught.value)
    assert handles._free == {0: []}  # nothing half-made is pooled
