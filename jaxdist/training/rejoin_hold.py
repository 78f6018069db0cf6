"""``JAXDIST_FAULT_HOLD_FOR_REJOIN=STEP``: a fault-injection hook for tests of in-process recovery.

While a process is missing, the live processes wait before that step until a replacement has
connected, so a test of the rejoin does not depend on the replacement starting before the run's
end. ``recovery.StepGuard`` polls it at each entry of ``live_devices``: every live process sees
the same live set and each poll is a barrier, so they all decide alike, and the bound is a
count of polls rather than a clock each would read differently.
"""

from __future__ import annotations

import logging
import os

from jaxdist.errors import JaxdistError

log = logging.getLogger(__name__)
ENV_HOLD = "JAXDIST_FAULT_HOLD_FOR_REJOIN"  # test-only: "STEP"
POLL_S = 0.1
MAX_POLLS = 3000  # about 5 min of polls, then the run goes on without the replacement


class RejoinHold:
    def __init__(self):
        spec = os.environ.get(ENV_HOLD, "")
        if spec and not spec.isdigit():
            raise JaxdistError(f"{ENV_HOLD}={spec!r}: expected STEP (a fault-injection hook for tests)")
        self.step = int(spec) if spec else None

    def holds(self, step: int, live: int, everyone: int, polls: int) -> bool:
        """Whether to wait before ``step`` (``live`` of ``everyone`` devices alive; ``polls`` so far)."""
        if step != self.step or live == everyone:
            return False
        if polls == 0:
            log.info(f"fault injection ({ENV_HOLD}): holding before step {step} until a replacement rejoins")
        if polls < MAX_POLLS:
            return True
        log.warning(f"fault injection ({ENV_HOLD}): no replacement rejoined within {MAX_POLLS} polls; going on without it")
        return False
