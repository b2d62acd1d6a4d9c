"""The autotuner's quality gate: a plan's validation loss against the baseline's seed distribution.

The rule (docs/quality.md, "The autotuner's quality gate"):

* The baseline is trained over ``n >= 3`` seeds. Its validation losses give the **mean** ``mu`` and
  the **spread** ``s = max - min`` (the range of the seeds). The range, not the standard deviation:
  with 3-5 seeds a standard deviation is itself a noisy estimate (its relative error at n=3 is about
  50%), while the range is what was actually seen; a run of the baseline itself lands inside it (or
  just past it) and so stays under ``mu + s``.
* The tolerance ``tau`` is relative (the autotuner's ``val_loss_tolerance``, 0.01 = 1%): the allowed
  slack is ``delta = tau * mu`` and the **limit** is ``mu + delta``. A candidate (one loss, or the
  mean of its seeds when a list is given) is **accepted** iff it is finite and ``<= limit``. The test
  is one-sided: a lower loss than the baseline's is always accepted.
* The gate refuses to be built when ``delta <= s``: a slack no larger than the seeds' own spread
  cannot tell a damaging plan from seed noise (a baseline-quality plan could be rejected by chance,
  and a plan worse than the baseline by up to ``delta`` is indistinguishable from noise). The fix is to
  train longer (the spread shrinks as runs converge), use more seeds, or allow a larger tolerance.

The module is pure Python (torch is not needed); it imports no engine and no model code.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["MIN_SEEDS", "GateVerdict", "QualityGate"]

MIN_SEEDS = 3
"""Fewest baseline seeds a gate accepts: with two, the range is a single difference."""


@dataclass(frozen=True)
class GateVerdict:
    """What ``QualityGate.check`` decided, with the figures it decided on.

    Attributes:
        accepted: the candidate's loss is finite and at most ``limit``.
        candidate: the candidate's validation loss (the mean of its seeds when several were given).
        candidate_losses: every candidate loss given.
        baseline_mean: the baseline seeds' mean validation loss.
        spread: the baseline seeds' range (max - min).
        limit: ``baseline_mean * (1 + tolerance)``.
        margin: ``limit - candidate``: headroom when positive, the excess when negative (nan if the
            candidate is not finite).
        reason: one line that says why.
    """

    accepted: bool
    candidate: float
    candidate_losses: tuple[float, ...]
    baseline_mean: float
    spread: float
    limit: float
    margin: float
    reason: str

    def __bool__(self) -> bool:
        return self.accepted

    def __str__(self) -> str:
        return self.reason

    def to_dict(self) -> dict:
        """The verdict as plain JSON-able data."""
        d = asdict(self)
        d["candidate_losses"] = list(self.candidate_losses)
        return d


def _losses(name: str, values) -> list[float]:
    if isinstance(values, (int, float)):
        values = [values]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a float or a list of floats, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise TypeError(f"{name}[{i}]={v!r} is not a number") from None
    return out


class QualityGate:
    """Accepts a plan whose validation loss is within ``tolerance`` of the baseline seeds' mean.

    Args:
        baseline_losses: the baseline's validation loss at each of ``>= 3`` seeds (finite, the mean
            positive).
        tolerance: relative slack over the baseline mean (0.01 = 1%); its absolute value
            ``tolerance * mean`` must exceed the seeds' spread.

    Raises:
        ValueError: fewer than 3 seeds, a non-finite or non-positive-mean baseline, a negative
            tolerance, or a tolerance at or below the measured spread.

    Attributes:
        losses, mean, spread (max - min of the seeds), std (sample standard deviation, reported only),
        tolerance, slack (``tolerance * mean``), limit (``mean + slack``).
    """

    def __init__(self, baseline_losses: Sequence[float], tolerance: float):
        losses = _losses("baseline_losses", baseline_losses)
        if len(losses) < MIN_SEEDS:
            raise ValueError(
                f"baseline_losses has {len(losses)} seed(s): the gate needs at least {MIN_SEEDS} to measure "
                f"seed noise (autotune.seeds >= {MIN_SEEDS})")
        bad = [v for v in losses if not math.isfinite(v)]
        if bad:
            raise ValueError(f"baseline_losses={losses}: {len(bad)} non-finite value(s); the baseline "
                             "diverged or its evaluation failed, so it cannot anchor the gate")
        tolerance = float(tolerance)
        if not math.isfinite(tolerance) or tolerance < 0:
            raise ValueError(f"tolerance={tolerance}: must be a finite fraction >= 0 (0.01 = 1%)")
        mean = statistics.fmean(losses)
        if mean <= 0:
            raise ValueError(f"baseline_losses={losses}: mean {mean} <= 0; a relative tolerance needs a "
                             "positive validation loss (cross entropy)")
        self.losses = losses
        self.mean = mean
        self.spread = max(losses) - min(losses)
        self.std = statistics.stdev(losses)
        self.tolerance = tolerance
        self.slack = tolerance * mean
        self.limit = mean + self.slack
        if self.slack <= self.spread:
            raise ValueError(
                f"the gate cannot tell a plan from seed noise: baseline spread {self.spread:.4g} "
                f"({100 * self.spread / mean:.2f}% of the mean {mean:.4g}, seeds {_fmt(losses)}) >= "
                f"tolerance {self.slack:.4g} (tolerance={tolerance:g}); train longer or use more seeds, "
                f"or raise the tolerance above {self.spread / mean:.4g}")

    def check(self, candidate_losses: float | Sequence[float]) -> GateVerdict:
        """Judge a candidate plan's validation loss (one run, or several seeds: their mean is judged).

        Args:
            candidate_losses: a loss or a non-empty list of losses; a non-finite one is rejected.

        Returns:
            A ``GateVerdict`` (truthy when accepted).
        """
        losses = _losses("candidate_losses", candidate_losses)
        if not losses:
            raise ValueError("candidate_losses is empty: give the plan's validation loss")
        cand = statistics.fmean(losses) if all(math.isfinite(v) for v in losses) else float("nan")
        base = (f"baseline {self.mean:.4f} over {len(self.losses)} seeds (spread {self.spread:.4f}), "
                f"limit {self.limit:.4f} (+{100 * self.tolerance:.2g}%)")
        what = "val loss" if len(losses) == 1 else f"val loss (mean of {len(losses)})"
        if not math.isfinite(cand):
            return GateVerdict(False, cand, tuple(losses), self.mean, self.spread, self.limit, float("nan"),
                               f"rejected: {what} is not finite ({_fmt(losses)}); {base}")
        margin = self.limit - cand
        ok = margin >= 0
        rel = 100 * (cand - self.mean) / self.mean
        reason = (f"{'accepted' if ok else 'rejected'}: {what} {cand:.4f} ({rel:+.2f}% vs baseline) "
                  f"{'<=' if ok else '>'} limit {self.limit:.4f}; {base}")
        return GateVerdict(ok, cand, tuple(losses), self.mean, self.spread, self.limit, margin, reason)

    def to_dict(self) -> dict:
        """The gate's figures for reports: losses, mean, spread, std, tolerance, slack, limit."""
        return {"losses": list(self.losses), "seeds": len(self.losses), "mean": self.mean,
                "spread": self.spread, "spread_kind": "max - min", "std": self.std,
                "tolerance": self.tolerance, "slack": self.slack, "limit": self.limit}

    def __repr__(self) -> str:
        return (f"QualityGate(mean={self.mean:.4f}, spread={self.spread:.4f}, tolerance={self.tolerance:g}, "
                f"limit={self.limit:.4f})")


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"
