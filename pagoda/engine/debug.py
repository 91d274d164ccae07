"""Debug switches read from the environment, in a module of their own so that the core
process's entry point can read them without importing the engine."""

from __future__ import annotations

import os

# Set to anything but "" or "0": every engine (in-process or core process) runs its idle check
# whenever it goes idle.
DEBUG_CHECK_IDLE_ENV = "PAGODA_DEBUG_CHECK_IDLE"


def debug_check_idle_enabled() -> bool:
    return os.environ.get(DEBUG_CHECK_IDLE_ENV, "") not in ("", "0")
