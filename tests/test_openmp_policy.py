"""`import pagoda` makes torch's OpenMP threads sleep between regions, and says whether that took
effect (`pagoda.OPENMP_THREADS_SLEEP`): only when pagoda came before torch and nothing else set
the policy or a spin count. Each case in a fresh interpreter (the policy is read once, when
torch loads its OpenMP runtime)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    ("first", "env", "sleeps"),
    [
        ("pagoda", {}, True),
        ("torch", {}, False),
        ("pagoda", {"OMP_WAIT_POLICY": "active"}, False),
        ("pagoda", {"OMP_WAIT_POLICY": "passive"}, True),
        ("pagoda", {"GOMP_SPINCOUNT": "10000"}, False),
    ],
    ids=["pagoda-first", "torch-first", "active", "user-passive", "spin-count"],
)
def test_openmp_threads_sleep_only_where_pagoda_s_policy_took_effect(first: str, env: dict, sleeps: bool) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), clean.get("PYTHONPATH", "")])
    code = f"import {first}; import pagoda, os; print(pagoda.OPENMP_THREADS_SLEEP, os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    said, policy = result.stdout.split()
    assert said == str(sleeps)
    assert policy.upper() == env.get("OMP_WAIT_POLICY", "PASSIVE").upper()  # pagoda never overrides a user's
