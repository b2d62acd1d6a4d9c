"""A communication-aware pipeline simulator with a memory model.

Each rank runs its actions in program order. An action starts when the rank is free and its inputs
have arrived:

- ``F`` of model piece ``i`` needs piece ``i-1``'s activation (same micro-batch) delivered;
- ``B`` of piece ``i`` needs its own ``F`` and piece ``i+1``'s gradient delivered;
- ``W`` of piece ``i`` needs its own ``B``.

A message between two ranks costs ``encode`` on the sender, ``latency + bytes / bandwidth`` on the
directed link (transfers on one link are serialized in the order they are sent) and ``decode`` on the
receiver. With ``LinkModel.overlap`` the transfer runs beside compute; without it the sender is
blocked until the transfer ends (as blocking ``send`` in DeepSpeed's engine). A schedule whose next
action can never become ready on any rank is a deadlock: ``ScheduleError`` shows the grid with the
stuck action of the lowest blocked rank marked.

Memory per rank = static categories (weights by format, gradients, master weights, optimizer states)
+ communication buffers + error-feedback / AQ-SGD buffers + activations in flight. A forward allocates
its chunk's saved activations at its start; B frees them (all of them, or all but
``weight_grad_inputs`` when a W follows); W frees the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Schedule, ScheduleError, format_grid

__all__ = ["StageCost", "LinkModel", "StageMemory", "SimResult", "StageStats", "simulate",
           "validate_schedule", "split_costs"]


@dataclass(frozen=True)
class StageCost:
    """Seconds per micro-batch for one model piece (one stage, or one chunk of an interleaved rank).

    ``backward_input`` and ``backward_weight`` are the two parts of backward; a schedule without W
    actions runs them together in B. ``recompute`` is the extra forward that activation
    recomputation adds to backward. ``optimizer`` is the time after the last action (gradient
    reduction and optimizer step), charged once per step on the piece's rank.
    """

    forward: float
    backward_input: float
    backward_weight: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight + self.recompute


@dataclass(frozen=True)
class LinkModel:
    """Point-to-point links between ranks: ``latency_s + bytes / bandwidth_Bps`` per message.

    The package's one link model: the simulator sends every message over it and the planner
    (``autotune.planner``) charges its stage-to-stage sends with ``time``. The defaults are free links.

    Attributes:
        latency_s, bandwidth_Bps: every link that ``overrides`` does not name.
        overlap: in the simulator, a transfer runs beside the sender's compute (True) or blocks the
            sender until it is delivered (False: DeepSpeed's blocking p2p).
        overrides: ``{(a, b): (latency_s, bandwidth_Bps)}`` for the directed link from rank ``a`` to ``b``.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = float("inf")
    overlap: bool = True
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"LinkModel.latency_s={self.latency_s} must be >= 0")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"LinkModel.bandwidth_Bps={self.bandwidth_Bps} must be > 0 "
                             "(use float('inf') for free links)")

    def time(self, nbytes: float, src: int | None = None, dst: int | None = None) -> float:
        """Seconds a message of ``nbytes`` takes on the link from rank ``src`` to ``dst`` (without them: on
        the default link); 0 for no bytes, which sends no message."""
        if nbytes <= 0:
            return 0.0
        lat, bw = self.overrides.get((src, dst), (self.latency_s, self.bandwidth_Bps))
        return lat + nbytes / bw


@dataclass(frozen=True)
class StageMemory:
    """Memory of one rank in bytes.

    Attributes:
        static: bytes that live all step, by memory category (``deepspeed_ppq.memory_categories``), e.g.
            ``{"weights.int4": ..., "weights.fp32": ..., "gradients": ..., "master_weights": ...,
            "optimizer": ...}``; the peak adds ``comm_buffers``, ``feedback_buffers`` and ``activations``.
        activation_per_microbatch: activations one forward of one chunk saves for its backward
            (with recomputation: only the checkpointed inputs).
        comm_buffers: send/receive buffers (the codec's packed payloads included).
        feedback_buffers: error-feedback and AQ-SGD buffers.
        weight_grad_inputs: the part of a micro-batch's activations that W still needs after B.
    """

    static: dict = field(default_factory=dict)
    activation_per_microbatch: int = 0
    comm_buffers: int = 0
    feedback_buffers: int = 0
    weight_grad_inputs: int = 0


@dataclass
class StageStats:
    """Per-rank times (seconds) and memory (bytes) of one simulated step."""

    busy: float = 0.0           # compute, recomputation and codec time
    comm: float = 0.0           # wire time of the messages this rank sends
    comm_blocked: float = 0.0   # time the rank was blocked sending (LinkModel.overlap=False)
    idle: float = 0.0           # step_time - busy - comm_blocked
    end: float = 0.0            # when its last action ended
    peak_memory: dict = field(default_factory=dict)   # category -> bytes at the rank's peak
    peak_total: int = 0
    peak_inflight: int = 0      # micro-batch-chunks held at once between their F and B
    memory_timeline: list = field(default_factory=list)  # [(time, activation bytes)] after each change


@dataclass
class SimResult:
    """Simulated step.

    Attributes:
        step_time: seconds from the first action to the end of the last rank's optimizer step.
        bubble_fraction: mean over ranks of idle time / step time.
        per_stage: ``StageStats`` per rank.
        events: ``(rank, kind, microbatch, chunk, piece, start, end)`` compute events and
            ``("comm", src, dst, boundary, "act"|"grad", microbatch, start, end)`` transfers.
    """

    step_time: float
    bubble_fraction: float
    per_stage: list[StageStats]
    events: list
    schedule: Schedule | None = None

    @property
    def peak_memory(self) -> list[dict]:
        return [s.peak_memory for s in self.per_stage]


_F, _B, _W = 0, 1, 2
_KIND = {"F": _F, "B": _B, "W": _W}


def _piece_list(values, n: int, v: int, what: str, ranks: int) -> list:
    if len(values) == n:
        return list(values)
    raise ValueError(f"{what} has {len(values)} entries: give one per model piece ({n} = {ranks} ranks"
                     f" x {v} chunks); see split_costs() to divide per-rank figures")


def _compile(schedule: Schedule):
    """Check every action against the placement and coverage; return per-rank instruction tuples."""
    m, n = schedule.num_microbatches, schedule.num_pieces
    split = schedule.split_backward
    seen: dict = {}
    prog = []
    for r, row in enumerate(schedule.actions):
        ins = []
        for i, a in enumerate(row):
            if a.stage != r:
                raise ScheduleError(f"action {a} is in rank {r}'s row but names stage {a.stage}\n"
                                    + format_grid(schedule, (r, i)))
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"action {a}: micro-batch {a.microbatch} is outside 0..{m - 1}\n"
                                    + format_grid(schedule, (r, i)))
            piece = schedule.piece_of(r, a.chunk, a.microbatch)
            if piece < 0:
                raise ScheduleError(f"action {a}: rank {r} chunk {a.chunk} does not process micro-batch "
                                    f"{a.microbatch} under placement {schedule.placement!r} with "
                                    f"{schedule.virtual_stages} chunks\n" + format_grid(schedule, (r, i)))
            k = _KIND[a.kind]
            key = (k, piece, a.microbatch)
            if key in seen:
                raise ScheduleError(f"action {a} appears twice (first at rank {seen[key][0]} index "
                                    f"{seen[key][1]})\n" + format_grid(schedule, (r, i)))
            seen[key] = (r, i)
            ins.append((k, piece, a.microbatch, a.chunk))
        prog.append(ins)
    want = m * n * (3 if split else 2)
    if len(seen) != want:
        for k in (_F, _B, _W) if split else (_F, _B):
            for piece in range(n):
                for mb in range(m):
                    if (k, piece, mb) not in seen:
                        rank, chunk = schedule.route(mb)[piece]
                        raise ScheduleError(f"schedule never runs {'FBW'[k]} of micro-batch {mb} on rank "
                                            f"{rank} chunk {chunk} (model piece {piece})\n"
                                            + format_grid(schedule))
    return prog


def simulate(schedule: Schedule, costs: list[StageCost], boundary_bytes: list[tuple[int, int]] | None = None,
             link: LinkModel | None = None, memory: list[StageMemory] | None = None,
             codec_time: list[tuple] | None = None) -> SimResult:
    """Simulate one training step of ``schedule``.

    Args:
        schedule: from ``build_schedule`` or ``load_schedule_csv``.
        costs: one ``StageCost`` per model piece (``schedule.num_pieces``: stages x chunks, or stages
            for chimera), in forward order.
        boundary_bytes: per boundary between piece ``i`` and ``i+1``: (activation bytes forward,
            gradient bytes backward) on the wire, i.e. after compression. ``None``: nothing sent.
        link: the link model; ``None`` means free, instant communication.
        memory: one ``StageMemory`` per rank, or ``None`` to skip the memory model.
        codec_time: per boundary, ``(activation_s, gradient_s)`` total codec seconds per message (half
            charged to the sender as encode, half to the receiver as decode) or
            ``(act_encode, act_decode, grad_encode, grad_decode)``.

    Returns:
        ``SimResult`` with step time, bubble fraction, per-rank busy/idle/comm and memory peaks.

    Raises:
        ScheduleError: for an invalid schedule or a deadlock (with the grid, failing cell marked).
        ValueError: for inputs of the wrong length.
    """
    p, m, n = schedule.num_ranks, schedule.num_microbatches, schedule.num_pieces
    v = schedule.virtual_stages
    costs = _piece_list(costs, n, v, "costs", p)
    nb = n - 1
    bbytes = [(0, 0)] * nb
    if boundary_bytes is not None:
        bbytes = _piece_list(boundary_bytes, nb, v, "boundary_bytes", p)
    link = link or LinkModel()
    enc_f = [0.0] * nb
    dec_f = [0.0] * nb
    enc_g = [0.0] * nb
    dec_g = [0.0] * nb
    if codec_time is not None:
        for i, ct in enumerate(_piece_list(codec_time, nb, v, "codec_time", p)):
            if len(ct) == 2:
                enc_f[i] = dec_f[i] = ct[0] / 2
                enc_g[i] = dec_g[i] = ct[1] / 2
            elif len(ct) == 4:
                enc_f[i], dec_f[i], enc_g[i], dec_g[i] = ct
            else:
                raise ValueError(f"codec_time[{i}]={ct} must have 2 or 4 entries")
    if memory is not None and len(memory) != p:
        raise ValueError(f"memory has {len(memory)} entries: give one StageMemory per rank ({p})")
    prog = _compile(schedule)
    split = schedule.split_backward
    routes = [schedule.route(mb) for mb in range(m)] if schedule.placement == "chimera" else None
    route0 = schedule.route(0)

    # Durations per (kind, piece).
    dur_f = [c.forward for c in costs]
    dur_b = [c.backward_input + c.recompute + (0.0 if split else c.backward_weight) for c in costs]
    dur_w = [c.backward_weight for c in costs]
    # Ready times of inputs at the consumer: act[piece][mb] = activation of piece delivered to piece+1.
    nan = -1.0
    act_ready = [[nan] * m for _ in range(n)]
    grad_ready = [[nan] * m for _ in range(n)]
    f_end = [[nan] * m for _ in range(n)]
    b_end = [[nan] * m for _ in range(n)]
    link_free: dict = {}
    clock = [0.0] * p
    busy = [0.0] * p
    comm = [0.0] * p
    blocked = [0.0] * p
    pc = [0] * p
    events: list = []
    mem_events: list[list] = [[] for _ in range(p)]
    overlap = link.overlap
    lat_bw_cache: dict = {}

    def send(src: int, dst: int, t: float, nbytes: int) -> tuple[float, float]:
        key = (src, dst)
        lb = lat_bw_cache.get(key)
        if lb is None:
            lb = lat_bw_cache[key] = link.overrides.get(key, (link.latency_s, link.bandwidth_Bps))
        start = max(t, link_free.get(key, 0.0))
        wire = lb[0] + nbytes / lb[1]
        end = start + wire
        link_free[key] = end
        comm[src] += wire
        return start, end

    act_mem = [memory[r].activation_per_microbatch if memory else 0 for r in range(p)]
    held_w = [min(memory[r].weight_grad_inputs, memory[r].activation_per_microbatch) if memory else 0
              for r in range(p)]
    remaining = sum(len(x) for x in prog)
    lens = [len(x) for x in prog]
    while remaining:
        progressed = False
        for r in range(p):
            ins = prog[r]
            i = pc[r]
            t = clock[r]
            while i < lens[r]:
                k, piece, mb, chunk = ins[i]
                route = routes[mb] if routes is not None else route0
                if k == _F:
                    if piece > 0:
                        ready = act_ready[piece - 1][mb]
                        if ready < 0:
                            break
                        extra = dec_f[piece - 1] if route[piece - 1][0] != r else 0.0
                    else:
                        ready, extra = 0.0, 0.0
                    start = ready if ready > t else t
                    end = start + extra + dur_f[piece]
                    f_end[piece][mb] = end
                    busy[r] += end - start
                    mem_events[r].append((start, act_mem[r], 1))
                    t = end
                    if piece < nb:
                        dst = route[piece + 1][0]
                        if dst == r:
                            act_ready[piece][mb] = end
                        else:
                            t = end + enc_f[piece]
                            busy[r] += enc_f[piece]
                            s0, s1 = send(r, dst, t, bbytes[piece][0])
                            events.append(("comm", r, dst, piece, "act", mb, s0, s1))
                            act_ready[piece][mb] = s1
                            if not overlap:
                                blocked[r] += s1 - t
                                t = s1
                elif k == _B:
                    fe = f_end[piece][mb]
                    if fe < 0:
                        break
                    if piece < nb:
                        ready = grad_ready[piece + 1][mb]
                        if ready < 0:
                            break
                        extra = dec_g[piece] if route[piece + 1][0] != r else 0.0
                        if fe > ready:
                            ready = fe
                    else:
                        ready, extra = fe, 0.0
                    start = ready if ready > t else t
                    end = start + extra + dur_b[piece]
                    b_end[piece][mb] = end
                    busy[r] += end - start
                    freed = act_mem[r] - held_w[r] if split else act_mem[r]
                    mem_events[r].append((end, -freed, -1))
                    t = end
                    if piece > 0:
                        dst = route[piece - 1][0]
                        if dst == r:
                            grad_ready[piece][mb] = end
                        else:
                            t = end + enc_g[piece - 1]
                            busy[r] += enc_g[piece - 1]
                            s0, s1 = send(r, dst, t, bbytes[piece - 1][1])
                            events.append(("comm", r, dst, piece - 1, "grad", mb, s0, s1))
                            grad_ready[piece][mb] = s1
                            if not overlap:
                                blocked[r] += s1 - t
                                t = s1
                else:
                    be = b_end[piece][mb]
                    if be < 0:
                        break
                    start = be if be > t else t
                    end = start + dur_w[piece]
                    busy[r] += end - start
                    mem_events[r].append((end, -held_w[r], 0))
                    t = end
                events.append((r, "FBW"[k], mb, chunk, piece, start, end))
                i += 1
            if i != pc[r]:
                remaining -= i - pc[r]
                pc[r] = i
                clock[r] = t
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock_message(schedule, prog, pc, f_end, b_end))

    # Optimizer step per rank: the sum over the pieces it holds.
    opt = [0.0] * p
    for piece, (r, _c) in enumerate(route0):
        opt[r] += costs[piece].optimizer
    if schedule.placement == "chimera":
        for piece, (r, _c) in enumerate(schedule.route(1)):
            opt[r] += costs[piece].optimizer
    ends = [clock[r] + opt[r] for r in range(p)]
    step = max(ends) if ends else 0.0
    stats = []
    for r in range(p):
        st = StageStats(busy=busy[r] + opt[r], comm=comm[r], comm_blocked=blocked[r], end=clock[r])
        st.idle = max(0.0, step - st.busy - blocked[r])
        _memory_peak(st, mem_events[r], memory[r] if memory else None)
        stats.append(st)
    bubble = sum(s.idle for s in stats) / (p * step) if step > 0 else 0.0
    return SimResult(step, bubble, stats, events, schedule)


def _deadlock_message(schedule: Schedule, prog, pc, f_end, b_end) -> str:
    """Which action each stuck rank waits at, and what it waits for."""
    n = schedule.num_pieces
    lines, marks = [], []
    for r, ins in enumerate(prog):
        if pc[r] >= len(ins):
            continue
        k, piece, mb, _ = ins[pc[r]]
        route = schedule.route(mb)
        if k == _F:
            need = ("F", piece - 1)
        elif k == _B:
            need = ("F", piece) if f_end[piece][mb] < 0 else ("B", piece + 1)
        else:
            need = ("B", piece)
        kind, q = need
        assert 0 <= q < n
        rank, chunk = route[q]
        tail = f"c{chunk}" if chunk else ""
        lines.append(f"rank {r} waits at {schedule.actions[r][pc[r]]} (index {pc[r]}) for "
                     f"{rank}{kind}{mb}{tail}"
                     + (", which comes later in its own program" if rank == r else ""))
        marks.append((r, pc[r]))
    return ("deadlock: no rank can make progress\n  " + "\n  ".join(lines) + "\n"
            + format_grid(schedule, marks))


def _memory_peak(st: StageStats, evs: list, mem: StageMemory | None) -> None:
    """Fill the rank's activation timeline, in-flight peak and memory peak by category."""
    evs.sort(key=lambda e: (e[0], e[1]))  # at equal times, frees before allocations
    cur = inflight = peak = peak_n = 0
    timeline = []
    for t, delta, dn in evs:
        cur += delta
        inflight += dn
        if inflight > peak_n:
            peak_n = inflight
        if cur > peak:
            peak = cur
        timeline.append((t, cur))
    st.peak_inflight = peak_n
    st.memory_timeline = timeline
    if mem is None:
        return
    cats = {k: int(v) for k, v in mem.static.items()}
    cats["comm_buffers"] = mem.comm_buffers
    cats["feedback_buffers"] = mem.feedback_buffers
    cats["activations"] = peak
    st.peak_memory = cats
    st.peak_total = sum(cats.values())


def validate_schedule(schedule: Schedule) -> None:
    """Check placement, coverage (every F/B[/W] exactly once), dependencies and deadlock freedom.

    Raises:
        ScheduleError: with the step-by-rank grid and the failing cell marked.
    """
    n = schedule.num_pieces
    simulate(schedule, [StageCost(1.0, 1.0, 1.0)] * n)


def split_costs(per_rank: list[StageCost], schedule: Schedule) -> list[StageCost]:
    """Per-piece costs from per-rank costs: an interleaved rank's cost is split evenly over its chunks;
    chimera's pieces (each a whole stage) take the cost of the stage they are."""
    if len(per_rank) != schedule.num_ranks:
        raise ValueError(f"per_rank has {len(per_rank)} entries, expected one per rank "
                         f"({schedule.num_ranks})")
    if schedule.placement == "chimera":
        return list(per_rank)
    v = schedule.virtual_stages
    return [StageCost(c.forward / v, c.backward_input / v, c.backward_weight / v, c.recompute / v,
                      c.optimizer / v)
            for _ in range(v) for c in per_rank]
