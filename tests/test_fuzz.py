"""Fuzzing in the suite: the C API, the array APIs and the CPU engine's runtime, each in a
child process (``fuzzing``).

``fuzz_capi.py``, ``fuzz_arrays.py`` and ``fuzz_runtime.py`` say what they draw and what they
check. Here each runs for a few seconds (``FUZZ_SECONDS`` shares a longer time between them)
and must finish with no crash, no escaped exception, no undocumented status, no half-write,
no leak, no wrong result, no hang and no helper thread left stuck. The counts are printed
(``pytest -s``) for the record.
"""

import pytest

pytest.importorskip("hypothesis")  # a test extra; the GPU machine may not have it
from fuzzing import VIOLATIONS, budget, run_child


@pytest.mark.parametrize(
    ("target", "seconds"),
    [("fuzz_capi", 12.0), ("fuzz_arrays", 15.0), ("fuzz_runtime", 10.0)],
)
def test_fuzz(target, seconds):
    counts = run_child(target, budget(seconds))
    print(f"{target}: {counts}")
    assert {v: counts.get(v, 0) for v in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0), counts
    assert counts["examples"] > 0
    if target == "fuzz_arrays":  # good problems but for one raising producer were drawn
        assert counts["passed_through_alone"] > 0, counts
