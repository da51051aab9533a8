"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime (imported by
``pagedllm/__init__.py``, which runs before any pagedllm module imports torch).

torch's libgomp makes a thread that finished its share of a parallel region spin for a while
(``GOMP_SPINCOUNT``, ~300k iterations) before it sleeps. Every op of a decode step is such a
region, with a little Python in between, so the helper threads spin through those gaps. On a
machine whose cores other processes also use (the case pagedllm is measured on), the spinning
threads take the CPU time the working thread needs: 2 threads ran the 5M-parameter model 10-45x
slower than with ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once), and slower than 1 thread (README
"Performance"). So pagedllm asks for PASSIVE unless the user chose a policy
(``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set) or torch was imported first, when it is too
late to change. ``SET_BY_PAGEDLLM`` records whether it did (the vLLM benchmark backend leaves
vLLM at the user's environment).
"""

from __future__ import annotations

import os
import sys

SET_BY_PAGEDLLM = False
if ("torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
        and "GOMP_SPINCOUNT" not in os.environ):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    SET_BY_PAGEDLLM = True


def advice(num_threads: int) -> str | None:
    """A hint for the log when torch's default (spinning) policy is in force with threads."""
    if SET_BY_PAGEDLLM or num_threads < 2 or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    return ("torch was imported before pagedllm, so its OpenMP threads spin between ops; on a "
            "busy machine export OMP_WAIT_POLICY=PASSIVE before starting Python "
            "(see pagedllm/_openmp.py)")
