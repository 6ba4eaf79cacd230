"""Threads sharing the descriptor cache: eviction never closes a descriptor in use.

Eight threads run the array API (backward, training and inference forward, on problems of
different shapes so that a cache of capacity 2 keeps evicting) and the C API's whole cycle,
with a one-microsecond switch interval; every result is checked against PyTorch in float64.
The cache's own contract is checked with stand-in descriptors: none is closed while in use,
every one built is closed exactly once, and two threads building one key share one.
"""

import sys
import threading
import time

import numpy as np
import pytest
from helpers import (
    BACKWARD_ORDER,
    OUTPUTS,
    assert_close,
    capi_backward,
    random_values,
    reference,
    torch_inference,
    torch_training,
)

import cudnn_bn
from cudnn_bn.descriptor_cache import DescriptorCache

THREADS, ROUNDS = 8, 12
SHAPES = [(4, 3, 5), (3, 2, 4), (6, 3), (2, 4, 3, 2)]


@pytest.fixture
def busy(monkeypatch):
    """A two-entry cache and a one-microsecond thread switch interval."""
    cache = DescriptorCache(capacity=2)
    monkeypatch.setattr(cudnn_bn.api.call, "descriptor_cache", cache)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield cache
    sys.setswitchinterval(interval)
    cache.clear()


def _problem(shape, seed):
    values = random_values(shape, seed, bias=True)
    want = {
        "backward": reference(values["input"], values["grad_output"], values["weight"]),
        "inference": torch_inference(values),
        "training": torch_training(values, momentum=0.1),
    }
    return values, want


def _array_round(values, want) -> None:
    x, dy, w, b = (values[n] for n in ("input", "grad_output", "weight", "bias"))
    rm, rv = values["running_mean"].copy(), values["running_var"].copy()
    for got, expected in zip(
        cudnn_bn.batch_norm_backward(x, dy, w, None, None), want["backward"], strict=True
    ):
        assert_close(got, expected, np.float64)
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
    assert_close(y, want["inference"], np.float64)
    outputs = cudnn_bn.batch_norm_forward_training(x, w, b, rm, rv, momentum=0.1)
    for got, expected in zip((*outputs, rm, rv), want["training"], strict=True):
        assert_close(got, expected, np.float64)


def _capi_round(values, want) -> None:
    c = values["input"].shape[1]
    arrays = dict(values) | {
        "grad_input": np.full_like(values["input"], np.nan),
        "grad_weight": np.full(c, np.nan),
        "grad_bias": np.full(c, np.nan),
    }
    capi_backward({n: arrays[n] for n in BACKWARD_ORDER}, mode=0)
    for name, expected in zip(OUTPUTS, want["backward"], strict=True):
        assert_close(arrays[name], expected, np.float64)


def test_eight_threads_through_both_apis_with_a_tiny_cache(busy):
    problems = [_problem(shape, seed) for seed, shape in enumerate(SHAPES)]
    failures: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for round_ in range(ROUNDS):
                values, want = problems[(index + round_) % len(problems)]
                (_capi_round if (index + round_) % 3 == 0 else _array_round)(values, want)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, f"{len(failures)} threads failed; first: {failures[0]!r}"
    assert len(busy) <= busy.capacity


class Fake:
    """A descriptor stand-in that records its closing and any use after it."""

    def __init__(self, registry: list) -> None:
        self.closed = 0
        registry.append(self)

    def use(self) -> None:
        assert not self.closed, "a descriptor in use was closed"
        time.sleep(0)

    def __exit__(self, *exc_info: object) -> None:
        self.closed += 1


class FakePlan:
    def __init__(self, registry: list) -> None:
        self.descriptor = Fake(registry)


def _get(cache: DescriptorCache, key: object, build) -> FakePlan:
    return cache.get(key) or cache.add(key, build())


def test_descriptors_in_use_are_closed_only_after_their_last_use():
    cache, built = DescriptorCache(capacity=1), []
    errors: list[BaseException] = []

    def build() -> FakePlan:
        time.sleep(0.0005)  # widen the window in which two threads build one key
        return FakePlan(built)

    def work(index: int) -> None:
        try:
            for round_ in range(200):
                plan = _get(cache, (index + round_) % 3, build)
                plan.descriptor.use()
                plan.descriptor.use()
                del plan
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, repr(errors[0])
    cache.clear()
    assert [d.closed for d in built] == [1] * len(built)  # none leaked, none closed twice


def test_two_builders_of_one_key_share_the_first():
    cache, built = DescriptorCache(capacity=4), []
    first_building, second_done = threading.Event(), threading.Event()

    def slow() -> FakePlan:
        first_building.set()
        second_done.wait(5)
        return FakePlan(built)

    holder: list[FakePlan] = []
    thread = threading.Thread(target=lambda: holder.append(_get(cache, "k", slow)))
    thread.start()
    first_building.wait(5)
    second = _get(cache, "k", lambda: FakePlan(built))
    second_done.set()
    thread.join()
    assert holder[0] is second and len(cache) == 1
    assert [d.closed for d in built] == [0, 1]  # the slower copy is closed, not leaked


def test_clear_while_in_use_closes_after_the_last_use():
    cache, built = DescriptorCache(), []
    plan = _get(cache, "k", lambda: FakePlan(built))
    cache.clear()
    plan.descriptor.use()
    descriptor = plan.descriptor
    del plan
    assert descriptor.closed == 1 and len(cache) == 0
