"""Schedules as data: an ``Action`` per unit of work, a ``Schedule`` as a table of actions per rank.

Notation (one action prints as one short token, as in PyTorch's ``pipelining/schedules.py``)::

    1F0     rank 1, forward of micro-batch 0 (model chunk 0)
    2B7     rank 2, backward of micro-batch 7; when the schedule also has W actions, B is the
            input-gradient part only
    0W3     rank 0, weight-gradient part of micro-batch 3's backward (zero-bubble schedules)
    1F4c1   rank 1, forward of micro-batch 4 on the rank's model chunk 1 ("c<chunk>" appears only
            for chunk > 0, so single-chunk schedules read exactly like the literature)

A rank holds one model chunk per virtual stage. Which chunk of which rank computes which piece of the
model, in which order, is the schedule's ``placement``:

- ``interleaved`` (covers plain 1F1B/GPipe with one chunk): micro-batch ``k`` visits
  ``(rank 0, chunk 0), (1, 0), ..., (p-1, 0), (0, 1), ..., (p-1, v-1)``: model piece ``c * p + r``.
- ``chimera``: two pipelines in opposite directions over two model replicas. Even micro-batches run
  "down" through chunk 0 of ranks ``0 .. p-1``; odd ones run "up" through chunk 1 of ranks
  ``p-1 .. 0``. Piece ``i`` of the model is on rank ``i`` (chunk 0) and on rank ``p-1-i`` (chunk 1).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

__all__ = ["Action", "Schedule", "ScheduleError", "parse_action", "load_schedule_csv", "dump_schedule_csv",
           "format_grid", "PLACEMENTS", "KINDS"]

KINDS = ("F", "B", "W")
PLACEMENTS = ("interleaved", "chimera")
_ACTION_RE = re.compile(r"^\s*(\d+)([FBW])(\d+)(?:c(\d+))?\s*$")


class ScheduleError(ValueError):
    """A schedule that cannot run: bad input, a missing dependency or a deadlock (message has the grid)."""


class Action(NamedTuple):
    """One unit of work on one rank: ``stage`` (the rank), ``kind`` (F/B/W), ``microbatch``, ``chunk``."""

    stage: int
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        tail = f"c{self.chunk}" if self.chunk else ""
        return f"{self.stage}{self.kind}{self.microbatch}{tail}"


def parse_action(text: str) -> Action:
    """Parse ``"1F0"`` / ``"3W12c1"`` back into an ``Action``.

    Raises:
        ScheduleError: if the text is not ``<stage><F|B|W><microbatch>[c<chunk>]``.
    """
    m = _ACTION_RE.match(text)
    if not m:
        raise ScheduleError(
            f"action {text!r} is malformed: expected <stage><F|B|W><microbatch>[c<chunk>], "
            "e.g. '1F0' or '2B3c1'"
        )
    return Action(int(m[1]), m[2], int(m[3]), int(m[4] or 0))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: for each rank, the ordered actions it runs in one training step.

    Attributes:
        name: builder name or a label.
        num_ranks: pipeline ranks ``p``.
        num_microbatches: micro-batches ``m`` per step.
        actions: ``actions[r]`` is rank ``r``'s program, in order.
        virtual_stages: model chunks per rank (``v``; 2 for chimera).
        placement: ``interleaved`` or ``chimera`` (see the module docstring).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1
    placement: str = "interleaved"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"placement={self.placement!r} is unknown: use one of "
                                f"{', '.join(PLACEMENTS)}")
        if self.placement == "chimera" and self.virtual_stages != 2:
            raise ScheduleError(f"placement='chimera' needs virtual_stages=2, got {self.virtual_stages}")
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(f"schedule has {len(self.actions)} rank rows but num_ranks={self.num_ranks}")

    @property
    def num_pieces(self) -> int:
        """Model pieces along one micro-batch's route (``p * v``, or ``p`` for chimera)."""
        return self.num_ranks if self.placement == "chimera" else self.num_ranks * self.virtual_stages

    @cached_property
    def split_backward(self) -> bool:
        """True when backward is split into B (input gradient) and W (weight gradient) actions."""
        return any(a.kind == "W" for row in self.actions for a in row)

    def route(self, microbatch: int) -> tuple[tuple[int, int], ...]:
        """The ``(rank, chunk)`` of each model piece, in forward order, for this micro-batch."""
        p = self.num_ranks
        if self.placement == "chimera":
            if microbatch % 2 == 0:
                return tuple((r, 0) for r in range(p))
            return tuple((p - 1 - i, 1) for i in range(p))
        return tuple((r, c) for c in range(self.virtual_stages) for r in range(p))

    def piece_of(self, rank: int, chunk: int, microbatch: int) -> int:
        """The model piece index that ``(rank, chunk)`` computes for ``microbatch`` (-1 if none)."""
        p = self.num_ranks
        if self.placement == "chimera":
            if chunk == microbatch % 2:
                return rank if chunk == 0 else p - 1 - rank
            return -1
        if 0 <= chunk < self.virtual_stages and 0 <= rank < p:
            return chunk * p + rank
        return -1

    def __str__(self) -> str:
        return format_grid(self)


def format_grid(schedule: Schedule, mark: tuple[int, int] | list[tuple[int, int]] | None = None,
                limit: int = 48) -> str:
    """The step-by-rank grid of a schedule; each marked ``(rank, index)`` is shown as ``>>1F0<<``.

    Args:
        schedule: the schedule to print.
        mark: the cell or cells to highlight (the failing actions), if any.
        limit: at most this many columns, around the first marked cell.
    """
    rows = [[str(a) for a in row] for row in schedule.actions]
    marks = [mark] if isinstance(mark, tuple) else list(mark or [])
    ncol = max((len(r) for r in rows), default=0)
    lo, hi = 0, ncol
    if ncol > limit:
        centre = min(i for _, i in marks) if marks else 0
        lo = max(0, min(centre - limit // 2, ncol - limit))
        hi = lo + limit
    for r, i in marks:
        if 0 <= r < len(rows) and 0 <= i < len(rows[r]):
            rows[r][i] = f">>{rows[r][i]}<<"
    width = max([len(c) for row in rows for c in row[lo:hi]] + [4])
    head = "rank | " + " ".join(f"{i:>{width}}" for i in range(lo, hi))
    lines = [f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_microbatches} micro-batches"
             + (f", columns {lo}..{hi - 1} of {ncol}" if (lo, hi) != (0, ncol) else ""), head]
    for r, row in enumerate(rows):
        cells = [f"{c:>{width}}" for c in row[lo:hi]] + [" " * width] * (hi - lo - len(row[lo:hi]))
        lines.append(f"{r:>4} | " + " ".join(cells))
    return "\n".join(lines)


def dump_schedule_csv(schedule: Schedule) -> str:
    """CSV text: a ``# key=value`` header line, then one row per rank: ``rank, action, action, ...``."""
    out = io.StringIO()
    out.write(f"# name={schedule.name} ranks={schedule.num_ranks} microbatches={schedule.num_microbatches} "
              f"virtual_stages={schedule.virtual_stages} placement={schedule.placement}\n")
    w = csv.writer(out, lineterminator="\n")
    for r, row in enumerate(schedule.actions):
        w.writerow([r, *map(str, row)])
    return out.getvalue()


def load_schedule_csv(source: str | Path, name: str | None = None) -> Schedule:
    """Load a schedule from CSV (a path or the text itself), as written by ``dump_schedule_csv``.

    The ``#`` header is optional: without it the ranks are the rows, the micro-batch count is inferred
    from the actions, ``virtual_stages`` is one more than the largest chunk, placement is interleaved.

    Raises:
        ScheduleError: naming the line and the problem (bad action, wrong rank, bad header value).
    """
    text = Path(source).read_text() if isinstance(source, Path) or "\n" not in str(source) else str(source)
    meta: dict[str, str] = {}
    rows: list[tuple[Action, ...]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("#"):
            for item in line.lstrip("# \t").split():
                if "=" not in item:
                    raise ScheduleError(f"line {lineno}: header item {item!r} is not key=value")
                k, v = item.split("=", 1)
                meta[k] = v
            continue
        cells = [c.strip() for c in next(csv.reader([line]))]
        if not cells[0].isdigit() or int(cells[0]) != len(rows):
            raise ScheduleError(f"line {lineno}: first cell must be the rank {len(rows)}, got {cells[0]!r}")
        acts = []
        for c in cells[1:]:
            if not c:
                continue
            try:
                a = parse_action(c)
            except ScheduleError as e:
                raise ScheduleError(f"line {lineno}: {e}") from None
            if a.stage != len(rows):
                raise ScheduleError(f"line {lineno}: action {c!r} names stage {a.stage} in the row of rank "
                                    f"{len(rows)}; each row holds only its own rank's actions")
            acts.append(a)
        rows.append(tuple(acts))
    if not rows:
        raise ScheduleError("schedule CSV has no rank rows")
    all_acts = [a for row in rows for a in row]

    def _int(key: str, default: int) -> int:
        v = meta.get(key)
        if v is None:
            return default
        if not v.isdigit() or int(v) < 1:
            raise ScheduleError(f"header {key}={v!r} must be a positive integer")
        return int(v)

    ranks = _int("ranks", len(rows))
    if ranks != len(rows):
        raise ScheduleError(f"header ranks={ranks} but the CSV has {len(rows)} rank rows")
    mbs = _int("microbatches", 1 + max((a.microbatch for a in all_acts), default=0))
    vs = _int("virtual_stages", 1 + max((a.chunk for a in all_acts), default=0))
    return Schedule(name or meta.get("name", "custom"), ranks, mbs, tuple(rows), vs,
                    meta.get("placement", "interleaved"))
