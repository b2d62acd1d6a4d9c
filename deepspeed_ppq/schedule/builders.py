"""Schedule builders: pure functions from (stages, micro-batches, virtual stages) to a ``Schedule``.

- ``gpipe``: all forwards, then all backwards (micro-batch order).
- ``1f1b``: ``p - 1 - s`` warm-up forwards on stage ``s``, then one forward / one backward, then the
  cool-down backwards (PipeDream-flush).
- ``interleaved``: Megatron's interleaved 1F1B with ``v`` chunks per rank (``m`` a multiple of ``p``).
- ``zbh1``: ZB-H1 from "Zero Bubble Pipeline Parallelism" (Qi et al., 2024): backward split into B
  (input gradient) and W (weight gradient); at most ``p - s`` micro-batches in flight on stage ``s``
  between F and B, as 1F1B, so the activation peak is 1F1B's plus the small inputs that pending Ws
  keep; W fills what would be bubbles. Bubble ``(p-1)(F+B-W)`` against 1F1B's ``(p-1)(F+B+W)``.
- ``chimera``: two pipelines in opposite directions (Li & Hoefler, 2021), even micro-batches down,
  odd ones up; each rank holds one piece of each of two model replicas.
- ``deepspeed``: the order DeepSpeed 0.19's ``TrainSchedule`` runs (``deepspeed/runtime/pipe/
  schedule.py``): lock-step 1F1B over ``2 * (m + p - 1)`` steps, forward on steps of the stage's parity.

``chimera`` is built by a list scheduler on unit costs with the memory limits above (``_greedy``);
the others follow their papers' formulas.
"""

from __future__ import annotations

from .actions import Action, Schedule, ScheduleError

__all__ = ["build_schedule", "SCHEDULES"]


def _check(name: str, p: int, m: int, v: int) -> None:
    for what, val in (("num_stages", p), ("num_microbatches", m), ("virtual_stages", v)):
        if not isinstance(val, int) or val < 1:
            raise ScheduleError(f"{name}: {what}={val!r} must be a positive integer")


def gpipe(p: int, m: int) -> Schedule:
    rows = tuple(tuple([Action(s, "F", k) for k in range(m)] + [Action(s, "B", k) for k in range(m)])
                 for s in range(p))
    return Schedule("gpipe", p, m, rows)


def one_f_one_b(p: int, m: int) -> Schedule:
    rows = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        row = [Action(s, "F", k) for k in range(warm)]
        for k in range(m - warm):
            row += [Action(s, "F", warm + k), Action(s, "B", k)]
        row += [Action(s, "B", k) for k in range(m - warm, m)]
        rows.append(tuple(row))
    return Schedule("1f1b", p, m, tuple(rows))


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``)."""
    if m % p:
        raise ScheduleError(f"interleaved: num_microbatches={m} must be a multiple of num_stages={p} "
                            "(micro-batches go through the chunks in groups of p)")
    total = m * v

    def fwd(k: int) -> tuple[int, int]:  # k-th forward of a rank -> (micro-batch, chunk)
        group, within = divmod(k, p * v)
        return group * p + within % p, within // p

    def bwd(k: int) -> tuple[int, int]:
        mb, chunk = fwd(k)
        return mb, v - 1 - chunk

    rows = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        row = [Action(s, "F", *fwd(k)) for k in range(warm)]
        for k in range(total - warm):
            row += [Action(s, "F", *fwd(warm + k)), Action(s, "B", *bwd(k))]
        row += [Action(s, "B", *bwd(k)) for k in range(total - warm, total)]
        rows.append(tuple(row))
    return Schedule(f"interleaved{v}", p, m, tuple(rows), virtual_stages=v)


def deepspeed_train(p: int, m: int) -> Schedule:
    """The F/B order of ``deepspeed.runtime.pipe.schedule.TrainSchedule`` (reimplemented, same steps)."""
    rows = []
    for s in range(p):
        row = []
        for step in range(2 * (m + p - 1)):
            even_step, even_stage = step % 2 == 0, s % 2 == 0
            if even_step == even_stage:  # forward step for this stage
                base = step // 2 if even_step else (step - 1) // 2
                mb, kind = base - s // 2, "F"
            elif even_step:  # odd stage, backward
                mb, kind = step // 2 - p + (s + 1) // 2, "B"
            else:  # even stage, backward
                mb, kind = (step - 1) // 2 - p + 1 + s // 2, "B"
            if 0 <= mb < m:
                row.append(Action(s, kind, mb))
        rows.append(tuple(row))
    return Schedule("deepspeed", p, m, tuple(rows))


def _greedy(name: str, p: int, m: int, v: int, placement: str, split: bool, limit,
            w_cap=lambda r: 0) -> Schedule:
    """List-schedule on unit costs: each free rank runs a ready B first, then F (within ``limit``),
    then a pending W; ties go to the lowest micro-batch.

    ``limit(rank, chunk)`` caps micro-batches in flight on that chunk, from its F until its B (the
    activations B frees); a W still pending holds only the smaller ``weight_grad_inputs``, and once
    ``w_cap(rank)`` Ws are pending the rank runs a W before anything else.
    """
    probe = Schedule(name, p, m, tuple(() for _ in range(p)), v, placement)
    routes = [probe.route(k) for k in range(m)]
    n = len(routes[0])
    done: dict = {}  # (kind, piece, mb) -> finish time
    inflight = {(r, c): 0 for r in range(p) for c in range(v)}
    rows: list[list[Action]] = [[] for _ in range(p)]
    # Work items per rank: F and B of every (piece, mb) it hosts.
    todo = {r: [] for r in range(p)}
    for k in range(m):
        for piece, (r, c) in enumerate(routes[k]):
            todo[r].append((piece, k, c))
    pending_w = {r: [] for r in range(p)}
    t = 0
    total = m * n * (3 if split else 2)
    count = 0
    while count < total:
        if t > 10 * total + 10:
            raise ScheduleError(f"{name}: the list scheduler made no progress (p={p}, m={m}); this is a bug")
        started = []
        for r in range(p):
            choice = None
            # 0) too many weight gradients pending
            if split and len(pending_w[r]) > w_cap(r):
                piece, k, c = pending_w[r].pop(0)
                choice = ("W", piece, k, c)
            # 1) a ready backward
            for piece, k, c in sorted(todo[r], key=lambda x: (x[1], -x[0])) if choice is None else ():
                if ("F", piece, k) in done and ("B", piece, k) not in done and done["F", piece, k] <= t and (
                        piece == n - 1 or done.get(("B", piece + 1, k), t + 1) <= t):
                    choice = ("B", piece, k, c)
                    break
            # 2) a ready forward within the memory limit
            if choice is None:
                for piece, k, c in sorted(todo[r], key=lambda x: (x[1], x[0])):
                    if ("F", piece, k) not in done and inflight[r, c] < limit(r, c) and (
                            piece == 0 or done.get(("F", piece - 1, k), t + 1) <= t):
                        choice = ("F", piece, k, c)
                        break
            # 3) a pending weight gradient
            if choice is None and pending_w[r]:
                piece, k, c = pending_w[r].pop(0)
                choice = ("W", piece, k, c)
            if choice is not None:
                started.append((r, choice))
        for r, (kind, piece, k, c) in started:
            done[kind, piece, k] = t + 1
            rows[r].append(Action(r, kind, k, c))
            count += 1
            if kind == "F":
                inflight[r, c] += 1
            elif kind == "B":
                todo[r].remove((piece, k, c))
                inflight[r, c] -= 1
                if split:
                    pending_w[r].append((piece, k, c))
        t += 1
    return Schedule(name, p, m, tuple(tuple(r) for r in rows), v, placement)


def zbh1(p: int, m: int) -> Schedule:
    """1F1B's F/B order with B the input gradient; stage ``s`` runs the W of a micro-batch ``s`` Bs
    later, so the input-gradient chain back to stage 0 never waits for a weight gradient and the
    deferred Ws fill the cool-down. At most ``s`` Ws are pending on stage ``s``."""
    base = one_f_one_b(p, m)
    rows = []
    for s, row in enumerate(base.actions):
        out, nb = [], 0
        for a in row:
            out.append(a)
            if a.kind == "B":
                if nb >= s:
                    out.append(Action(s, "W", nb - s))
                nb += 1
        out += [Action(s, "W", k) for k in range(max(0, m - s), m)]
        rows.append(tuple(out))
    return Schedule("zbh1", p, m, tuple(rows))


def chimera(p: int, m: int) -> Schedule:
    if p % 2 or m % 2:
        raise ScheduleError(f"chimera: num_stages={p} and num_microbatches={m} must both be even "
                            "(two pipelines in opposite directions share the micro-batches)")
    # Down pipeline (chunk 0): rank r is piece r, p - r in flight as 1F1B; up pipeline mirrored.
    return _greedy("chimera", p, m, 2, "chimera", False, lambda r, c: (p - r) if c == 0 else (r + 1))


SCHEDULES = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved,
    "zbh1": lambda p, m, v: zbh1(p, m),
    "chimera": lambda p, m, v: chimera(p, m),
    "deepspeed": lambda p, m, v: deepspeed_train(p, m),
}


def build_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a named schedule.

    Args:
        name: one of ``gpipe``, ``1f1b``, ``interleaved``, ``zbh1``, ``chimera``, ``deepspeed``.
        num_stages: pipeline ranks ``p``.
        num_microbatches: micro-batches per step ``m``.
        virtual_stages: chunks per rank (``interleaved`` only; must be 1 for the others).

    Raises:
        ScheduleError: for an unknown name or an impossible combination, naming the value and the rule.
    """
    key = name.lower().replace("-", "").replace("_", "")
    key = {"interleaved1f1b": "interleaved", "trainschedule": "deepspeed"}.get(key, key)
    if key not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is unknown: use one of {', '.join(SCHEDULES)}")
    _check(key, num_stages, num_microbatches, virtual_stages)
    if key != "interleaved" and virtual_stages != 1:
        raise ScheduleError(f"{key}: virtual_stages={virtual_stages} is only supported by 'interleaved'")
    if key == "interleaved" and virtual_stages < 2:
        raise ScheduleError(f"interleaved: virtual_stages={virtual_stages} must be >= 2 (1 is plain '1f1b')")
    return SCHEDULES[key](num_stages, num_microbatches, virtual_stages)
