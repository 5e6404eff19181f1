"""`--part I/N` (conftest.py): the parts of a selection are disjoint and together hold all of it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          os.path.join(TESTS, "test_views.py"), *args],
                         capture_output=True, text=True, cwd=TESTS, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_parts_split_a_selection_round_robin():
    whole = _collected()
    parts = [_collected("--part", f"{i}/3") for i in (1, 2, 3)]
    assert len(whole) >= 3
    assert sorted(sum(parts, [])) == sorted(whole)
    assert all(abs(len(p) - len(whole) / 3) < 1 for p in parts)
    assert parts[0] == whole[0::3]


@pytest.mark.parametrize("spec", ["2", "0/2", "3/2", "a/b"])
def test_a_bad_part_is_a_usage_error(spec):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          os.path.join(TESTS, "test_views.py"), "--part", spec],
                         capture_output=True, text=True, cwd=TESTS, timeout=300)
    assert out.returncode == 4 and "--part" in out.stderr, (out.returncode, out.stderr[-500:])
