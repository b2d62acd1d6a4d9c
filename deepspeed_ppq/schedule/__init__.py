"""Pipeline schedules as data, a communication-aware simulator with a memory model, and timelines.

Pure planning code (no torch.distributed). The autotuner codes against::

    sched = build_schedule("1f1b", num_stages=4, num_microbatches=8)
    validate_schedule(sched)                      # raises ScheduleError with the grid
    res = simulate(sched, costs=[StageCost(f, b_in, b_w)] * 4, boundary_bytes=[(act, grad)] * 3,
                   link=LinkModel(latency_s=5e-6, bandwidth_Bps=25e9), memory=[StageMemory(...)] * 4)
    res.step_time, res.bubble_fraction, res.per_stage[s].busy / .idle / .comm / .peak_memory

See docs/simulator.md.
"""

from .actions import (
    KINDS,
    PLACEMENTS,
    Action,
    Schedule,
    ScheduleError,
    dump_schedule_csv,
    format_grid,
    load_schedule_csv,
    parse_action,
)
from .builders import SCHEDULES, build_schedule
from .simulator import (
    LinkModel,
    SimResult,
    StageCost,
    StageMemory,
    StageStats,
    simulate,
    split_costs,
    validate_schedule,
)

__all__ = [
    "Action", "Schedule", "ScheduleError", "parse_action", "load_schedule_csv", "dump_schedule_csv",
    "format_grid", "KINDS", "PLACEMENTS", "SCHEDULES", "build_schedule", "StageCost", "LinkModel",
    "StageMemory", "StageStats", "SimResult", "simulate", "validate_schedule", "split_costs",
]
