"""Test-only fault injection into the engine's step loop, switched on by an environment variable.

`TOKIOS_INJECT_FAULT` holds one fault, or several separated by commas:

- `raise:N`: step N (counted from 1 since the engine started) raises RuntimeError, as a kernel
  or device failure would;
- `sleep:N:SECONDS`: step N sleeps that long before running, as a hung kernel would (the
  watchdog test).

The reliability tests start real servers with it (docs/reliability.md); nothing else reads it,
and with the variable unset the loop pays one integer comparison per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENVIRONMENT_VARIABLE = "TOKIOS_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """What a `raise:N` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str  # "raise" | "sleep"
    step: int
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        try:
            if parts[0] == "raise" and len(parts) == 2:
                faults.append(Fault("raise", int(parts[1])))
            elif parts[0] == "sleep" and len(parts) == 3:
                faults.append(Fault("sleep", int(parts[1]), float(parts[2])))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: cannot read {item!r}; expected raise:STEP or "
                             "sleep:STEP:SECONDS") from None
    return faults


class FaultInjector:
    def __init__(self, faults: list[Fault]):
        self._faults_by_step = {fault.step: fault for fault in faults}
        self._last_step = max(self._faults_by_step, default=0)
        self.num_steps = 0

    @classmethod
    def from_environment(cls) -> "FaultInjector":
        return cls(parse_faults(os.environ.get(ENVIRONMENT_VARIABLE, "")))

    def before_step(self) -> None:
        self.num_steps += 1
        if self.num_steps > self._last_step:
            return
        fault = self._faults_by_step.get(self.num_steps)
        if fault is None:
            return
        if fault.kind == "sleep":
            time.sleep(fault.seconds)
        else:
            raise InjectedFault(f"fault injected at step {fault.step} ({ENVIRONMENT_VARIABLE})")
