"""Chrome / Perfetto trace of a simulated step (open in https://ui.perfetto.dev or chrome://tracing).

One process per pipeline rank; thread 0 is compute (F/B/W slices), thread 1 the rank's outgoing
transfers; a counter track per rank shows activation bytes in flight over time.
"""

from __future__ import annotations

import json
from pathlib import Path

from .simulator import SimResult

__all__ = ["chrome_trace", "write_chrome_trace"]

_COLOR = {"F": "thread_state_running", "B": "rail_response", "W": "rail_animation", "act": "good",
          "grad": "bad"}


def chrome_trace(result: SimResult) -> dict:
    """The trace as a dict in the Chrome trace event format (times in microseconds)."""
    us = 1e6
    events = []
    ranks = len(result.per_stage)
    for r in range(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"stage {r}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "send"}})
    for e in result.events:
        if e[0] == "comm":
            _, src, dst, boundary, what, mb, t0, t1 = e
            events.append({"ph": "X", "pid": src, "tid": 1, "name": f"{what} {mb} -> {dst}", "ts": t0 * us,
                           "dur": (t1 - t0) * us, "cname": _COLOR[what],
                           "args": {"boundary": boundary, "microbatch": mb, "dst": dst}})
        else:
            r, kind, mb, chunk, piece, t0, t1 = e
            name = f"{kind}{mb}" + (f"c{chunk}" if chunk else "")
            events.append({"ph": "X", "pid": r, "tid": 0, "name": name, "ts": t0 * us, "dur": (t1 - t0) * us,
                           "cname": _COLOR[kind], "args": {"microbatch": mb, "chunk": chunk, "piece": piece}})
    for r, st in enumerate(result.per_stage):
        for t, nbytes in st.memory_timeline:
            events.append({"ph": "C", "pid": r, "name": "activation bytes", "ts": t * us,
                           "args": {"activations": nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"step_time_s": result.step_time, "bubble_fraction": result.bubble_fraction,
                         "schedule": result.schedule.name if result.schedule else None}}


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    """Write ``chrome_trace(result)`` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(result)))
    return path
