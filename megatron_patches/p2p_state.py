"""What the compressed P2P of ``megatron_patches.p2p`` keeps: per rank, per schedule call.

:class:`BoundaryCodecs` is one pipeline rank's state across steps: the upstream side of the boundary to
the next stage and the downstream side of the one from the previous stage (a
``deepspeed_ppq.compress.BoundaryChannel`` each), the step count, and the micro-batch numbering of the
schedule call under way (gradient ``n`` belongs to activation ``n``: the non-interleaved 1F1B schedule runs
backward passes in forward order on every stage).

A schedule call's context (``_CALL``, set by the wrapped schedule functions): training or evaluation,
the ranks' states it touched, and (AQ-SGD) the sample ids taken off its batches: ``(inputs, labels,
sample_ids)`` or a dict with a ``"sample_ids"`` entry, the same convention as the DeepSpeed engine. The
first stage sends a micro-batch's ids (``int64[B]``) in front of its activation payload and every later
stage forwards them with its own.

Non-finite values (``ppq.nonfinite``): with ``"error"`` the channels stop both sides of a boundary as the
message crosses. With ``"skip"`` a training schedule call opens a step of the codec state (EF/EF21/AQ-SGD
updates can be undone) and keeps where NaN/Inf crossed; the optimizer step (``megatron_patches.optim``
wraps megatron-core's) calls :func:`settle_step`, which takes the flag over every rank and, when any rank
saw one, skips the step on all of them and rolls the codec state back, so the step's batch leaves no trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepspeed_ppq.compress import BoundaryChannel
from deepspeed_ppq.config import PPQConfig, PPQConfigError

__all__ = ["BoundaryCodecs", "evaluating", "with_sample_ids", "settle_step", "device", "SAMPLE_DIM"]

SAMPLE_DIM = 1  # megatron-core's activations: [seq, micro-batch, hidden]


@dataclass
class _CallContext:
    training: bool = True
    touched: set = field(default_factory=set)
    sample_ids: deque = field(default_factory=deque)  # ids taken off the batches, in order (AQ-SGD)
    without_ids: str | None = None  # what a batch without ids was, for the error


_CALL: contextvars.ContextVar[_CallContext | None] = contextvars.ContextVar("ppq_megatron_call", default=None)
# the ranks' states whose training schedule calls ended since the last optimizer step (settle_step)
_PENDING: list[BoundaryCodecs] = []


def device() -> torch.device:
    """The device this rank communicates from."""
    if torch.cuda.is_available():
        # In CPU mode (megatron_patches.cpu_shim) CUDA reads as available and current_device() is "cpu".
        d = torch.cuda.current_device()
        return torch.device(d) if isinstance(d, (str, torch.device)) else torch.device("cuda", d)
    return torch.device("cpu")


@contextlib.contextmanager
def evaluating() -> Iterator[None]:
    """Mark the schedule calls inside as evaluation (codecs follow ``CodecConfig.eval_compressed``).

    Needed only when calling an unwrapped schedule function by hand; the wrapped ones
    (:func:`ppq_forward_backward_func`, the installed patch) read ``forward_only`` themselves.
    """
    token = _CALL.set(_CallContext(training=False))
    try:
        yield
    finally:
        _CALL.reset(token)


class BoundaryCodecs:
    """One pipeline rank's sides of its two boundaries, and the schedule's place in training.

    Args:
        cfg: the validated ``PPQConfig``.
        pp_rank, pp_size: this rank's position in the pipeline (names the boundaries in messages).

    Attributes:
        steps: training steps seen (``warmup_steps`` of them travel uncompressed).
        next, prev: the ``BoundaryChannel`` to the next stage (upstream side) and from the previous one
            (downstream side).
    """

    def __init__(self, cfg: PPQConfig, pp_rank: int, pp_size: int):
        self.cfg = cfg
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.steps = 0
        nxt, prv = (pp_rank + 1) % pp_size, (pp_rank - 1) % pp_size
        common = dict(stage=pp_rank, sample_dim=SAMPLE_DIM)
        self.next = BoundaryChannel(cfg, boundary=pp_rank, side="upstream",
                                    label=f"boundary {pp_rank} (stage {pp_rank} -> {nxt})", **common)
        self.prev = BoundaryChannel(cfg, boundary=prv, side="downstream",
                                    label=f"boundary {prv} (stage {prv} -> {pp_rank})", **common)
        self._count = dict.fromkeys(("act_out", "act_in", "grad_out", "grad_in"), 0)
        self._ids: dict[int, torch.Tensor] = {}  # received activations' sample ids, by micro-batch
        self.step_flags: list[str] = []  # where NaN/Inf crossed in the last training schedule call

    def _channel(self, direction: str, sending: bool) -> BoundaryChannel:
        return self.next if (direction == "activations") == sending else self.prev

    def _number(self, what: str) -> int:
        """The next micro-batch number of ``what`` in this schedule call."""
        n = self._count[what]
        self._count[what] += 1
        return n

    def _with_ids(self, ch: BoundaryChannel, direction: str, training: bool) -> bool:
        """Whether this message carries sample ids in front of its payload (AQ-SGD activations)."""
        coded = ch.mode(direction, training=training, step=self.steps) is not None
        return direction == "activations" and coded and ch.needs_sample_ids(training=training)

    @property
    def raw_bytes(self) -> dict[str, int]:
        """What the logical tensors this rank sent weigh, per direction."""
        return {"activations": self.next.stats["activations"]["raw_bytes"],
                "gradients": self.prev.stats["gradients"]["raw_bytes"]}

    @property
    def wire_bytes(self) -> dict[str, int]:
        """What this rank put on the wire, per direction: payloads (or tensors) and sample ids."""
        return {d: ch.stats[d]["wire_bytes"] + ch.stats[d]["side_bytes"]
                for d, ch in (("activations", self.next), ("gradients", self.prev))}

    def _outgoing_ids(self, n: int) -> torch.Tensor:
        """The sample ids of activation ``n``: the first stage takes them off its batch, a later stage
        forwards the ones its own activation ``n`` came with."""
        if self.pp_rank == 0:
            return _batch_ids()
        if n not in self._ids:
            raise RuntimeError(f"stage {self.pp_rank}: activation {n} of this schedule call goes out before "
                               "the one it was computed from came in (AQ-SGD needs the non-interleaved "
                               "schedule)")
        return self._ids.pop(n)

    def send(self, direction: str, x: torch.Tensor, training: bool) -> torch.Tensor:
        """What goes on the wire for ``x``: a payload (AQ-SGD: its sample ids in front), or ``x`` itself."""
        ch = self._channel(direction, sending=True)
        n = self._number("act_out" if direction == "activations" else "grad_out")
        kw = dict(micro_batch=n, training=training, step=self.steps)
        if not self._with_ids(ch, direction, training):
            return ch.send(direction, x, **kw)
        ids = self._outgoing_ids(n).to(x.device, torch.int64).reshape(-1)
        head = ids.numel() * ids.element_size()
        wire = torch.empty(head + ch.nbytes(direction, x.shape, x.dtype, training=training, step=self.steps),
                           dtype=torch.uint8, device=x.device)
        wire[:head] = ids.view(torch.uint8)
        ch.send(direction, x, sample_ids=ids, out=wire[head:], **kw)
        ch.count_side(direction, head)
        return wire

    def receive(self, direction: str, shape, dtype: torch.dtype, device, training: bool):
        """``(tensor, wire, finish)``: the tensor the schedule gets, what to receive into (a payload or the
        tensor itself) and the call that fills the tensor once the transfer is done."""
        ch = self._channel(direction, sending=False)
        n = self._number("act_in" if direction == "activations" else "grad_in")
        kw = dict(micro_batch=n, training=training, step=self.steps)
        out = torch.empty(shape, requires_grad=True, device=device, dtype=dtype)
        if ch.mode(direction, training=training, step=self.steps) is None:
            return out, out, lambda: ch.recv(direction, out, shape, dtype, **kw)
        head = 8 * shape[SAMPLE_DIM] if self._with_ids(ch, direction, training) else 0
        wire = torch.empty(head + ch.nbytes(direction, shape, dtype, training=training, step=self.steps),
                           dtype=torch.uint8, device=device)

        def finish():
            ids = None
            if head:
                ids = self._ids[n] = wire[:head].view(torch.int64).clone()  # forwarded with our activation
            ch.recv(direction, wire[head:], shape, dtype, sample_ids=ids, out=out, **kw)

        return out, wire, finish

    def raise_if_flagged(self) -> None:
        for ch in (self.next, self.prev):
            ch.raise_if_flagged(self.steps)

    @property
    def skips_steps(self) -> bool:
        """``ppq.nonfinite="skip"`` with a codec on: a flagged step is skipped on every rank."""
        cfg = self.cfg
        return cfg.nonfinite == "skip" and (cfg.activations.enabled or cfg.gradients.enabled)

    def begin_schedule(self, training: bool) -> None:
        """A schedule call's first message: a training call opens a step of the codec state."""
        if training:
            self.step_flags = []
            for ch in (self.next, self.prev):
                ch.begin_step()  # a step never settled (no optimizer step in between) is kept

    def end_schedule(self, training: bool, done: bool = True) -> None:
        """A schedule call ended: restart the micro-batch numbers, drop what is left of it. A training call
        that finished counts a step and waits for :func:`settle_step`; one that failed rolls back."""
        self._count = dict.fromkeys(self._count, 0)
        self._ids.clear()
        if training and done:
            self.step_flags = [where for ch in (self.next, self.prev) for where in ch.flagged]
            self.steps += 1
            if self not in _PENDING:
                _PENDING.append(self)
        elif training:
            for ch in (self.next, self.prev):
                ch.rollback()
        for ch in (self.next, self.prev):
            ch.clear_micro_batches()
            ch.clear_flags()


def settle_step() -> list[str] | None:
    """At the optimizer step (``megatron_patches.optim``): whether to skip it.

    With ``ppq.nonfinite="skip"``, the flag "NaN/Inf crossed a boundary in this step" is taken (max) over
    every rank of the default process group -- each pipeline's stages, and the data-parallel replicas whose
    gradients the flagged ones were averaged with -- so all of them skip together; the codec state then
    returns to where the step found it. Without a pending training step, or without ``"skip"``, nothing is
    exchanged (all ranks agree on that: they run the same schedules with the same settings).

    Returns:
        Where NaN/Inf were seen (``"another rank"`` when only other ranks saw them) when the step is to be
        skipped; ``None`` to go ahead (the codec state of the step is kept).
    """
    pending = list(_PENDING)
    _PENDING.clear()
    if any(c.skips_steps for c in pending):
        seen = [where for c in pending for where in c.step_flags]
        flag = torch.tensor([float(bool(seen))], device=device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            for c in pending:
                for ch in (c.next, c.prev):
                    ch.rollback()  # EF/EF21/AQ-SGD state as if this step's batch had never been seen
                c.step_flags = []
            where = seen or ["another rank"]
            warnings.warn(f"ppq: skipping the optimizer step after training step {pending[0].steps - 1}: "
                          f"NaN/Inf crossed a stage boundary (seen at {'; '.join(where)})", RuntimeWarning,
                          stacklevel=3)
            return where
    for c in pending:
        for ch in (c.next, c.prev):
            ch.commit()
        c.step_flags = []
    return None


def _batch_ids() -> torch.Tensor:
    """The sample ids of the next micro-batch the first stage sends (taken off its batch)."""
    ctx = _CALL.get()
    if ctx is None:
        raise PPQConfigError("ppq.aqsgd.enabled=true on megatron-core takes each micro-batch's sample ids "
                             "from its batch: run the schedule from ppq_forward_backward_func() or with "
                             "install_compressed_p2p() in effect")
    if not ctx.sample_ids:
        raise PPQConfigError(
            "ppq.aqsgd.enabled=true: every training batch must carry its samples' dataset indices, as "
            "(inputs, labels, sample_ids) or a dict with a 'sample_ids' entry; got "
            f"{ctx.without_ids or 'no batch for this micro-batch'}")
    return torch.as_tensor(ctx.sample_ids.popleft())


class _SampleIdBatches:
    """The schedule's data iterator, with each batch's sample ids taken off and queued (AQ-SGD)."""

    def __init__(self, batches, ctx: _CallContext):
        self._batches, self._ctx = batches, ctx

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._batches)
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            self._ctx.sample_ids.append(batch[2])
            return type(batch)(batch[:2])
        if isinstance(batch, dict) and "sample_ids" in batch:
            self._ctx.sample_ids.append(batch["sample_ids"])
            return {k: v for k, v in batch.items() if k != "sample_ids"}
        n = len(batch) if hasattr(batch, "__len__") else "?"
        self._ctx.without_ids = f"a {type(batch).__name__} of length {n}"
        return batch

    def __getattr__(self, name):  # anything else a forward step asks of its iterator
        return getattr(self._batches, name)


def with_sample_ids(batches, ctx: _CallContext):
    """``batches`` (a schedule's ``data_iterator``) with each batch's sample ids taken off into ``ctx``."""
    if isinstance(batches, (list, tuple)):
        if len(batches) > 1:
            raise PPQConfigError("ppq.aqsgd.enabled=true needs the non-interleaved schedule (one data "
                                 f"iterator), got {len(batches)} model chunks' iterators")
        return type(batches)(_SampleIdBatches(b, ctx) for b in batches)
    return _SampleIdBatches(batches, ctx)
