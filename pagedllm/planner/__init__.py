"""Capacity planning: replay traffic through the engine's own scheduler and KV manager, no model.

    replay.py     the replay loop: sched/ + kv/ exactly as the engine builds them, stand-in tokens
    cost.py       the step-cost model (a step's StepStats record -> seconds) and its fit
    profile.py    a fitted model and the setup it was measured on, as JSON
    grid.py       the calibration grid, sized to the pool and budget; the refusal naming the flag
    calibrate.py  times real engine steps over a grid (imports the engine: the one torch user)
    plan.py       one answer: settings x arrivals -> summary; the pool-sizing lines
    sweep.py      combinations of settings, SLOs, the largest request rate meeting one
    compare.py    the real engine on the same workload: predicted vs measured
    cli.py        ``pagedllm plan`` and ``pagedllm plan calibrate``

Importing this package (and everything but calibrate.py / compare.py) does not import torch.
"""

from pagedllm.planner.cost import StepCostModel, fit, step_features
from pagedllm.planner.replay import ReplayResult, replay, summarize

__all__ = ["ReplayResult", "StepCostModel", "fit", "replay", "step_features", "summarize"]
