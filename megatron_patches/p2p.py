"""Compressed stage-to-stage traffic inside megatron-core's own pipeline schedules.

Every P2P call of megatron-core 0.16.1 and 0.19.2 (``recv_forward``, ``send_forward_recv_backward``, ...) goes
through one method, ``P2PCommunicator._communicate``. :class:`PPQP2PCommunicator` overrides it: the
activation sent to the next stage and the gradient sent to the previous one travel as the codec's
flat ``uint8`` payload (``deepspeed_ppq.compress``); the receiver allocates the payload's exact size
(``payload_nbytes``: fixed per shape, dtype and codec, so nothing extra is exchanged) and decodes
into the logical tensor the schedule expects.

Two ways in:

- Megatron-LM's training loop builds ``P2PCommunicator(pp_group=..., config=...)`` from the
  module-global name in ``megatron.core.pipeline_parallel.schedules`` on every step.
  :func:`install_compressed_p2p` swaps that name for a subclass bound to one shared codec state
  (error-feedback buffers live across steps) and wraps the schedule functions so the communicator
  knows training from evaluation (``forward_only``) and counts steps (``warmup_steps``).
- megatron-core users pass ``p2p_communicator=PPQP2PCommunicator(pp_group, config, ppq=cfg)`` together
  with ``pg_collection=`` to a schedule from :func:`ppq_forward_backward_func`.

State per rank (one non-interleaved stage has one boundary each way): an encoder for activations to
the next stage and for gradients to the previous one, a decoder for each opposite direction. TopK
index reuse: the activation sender keeps the indices it chose per micro-batch, the receiver keeps the
ones it decoded; both consume them first-in first-out when the gradient of that micro-batch goes back
(the non-interleaved 1F1B schedule runs backward passes in forward order on every stage).

Deferred decoding: with ``batch_p2p_comm=False`` the interleaved schedule asks for the requests back
(``wait_on_reqs=False``) and waits on them later. The receive requests are then wrapped so that
``wait()`` finishes the transfer and decodes the payload into the tensor already handed to the
schedule; send requests keep their payload alive until they complete.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import p2p_communication as _p2p
from megatron.core.pipeline_parallel import schedules as _schedules

from deepspeed_ppq.config import CodecConfig, PPQConfig, load_ppq_config

from ._compat import check_megatron_version, check_patch_points

check_patch_points("compressed P2P")  # the class below subclasses P2PCommunicator: say what is missing

__all__ = [
    "PPQP2PCommunicator",
    "BoundaryCodecs",
    "install_compressed_p2p",
    "uninstall_compressed_p2p",
    "ppq_forward_backward_func",
    "evaluating",
    "bytes_on_wire",
    "format_bytes_on_wire",
]


@dataclass
class _CallContext:
    training: bool = True
    touched: set = field(default_factory=set)


_CALL: contextvars.ContextVar[_CallContext | None] = contextvars.ContextVar("ppq_megatron_call", default=None)


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


def _device() -> torch.device:
    if torch.cuda.is_available():
        # In CPU mode (megatron_patches.cpu_shim) CUDA reads as available and current_device() is "cpu".
        d = torch.cuda.current_device()
        return torch.device(d) if isinstance(d, (str, torch.device)) else torch.device("cuda", d)
    return torch.device("cpu")


class BoundaryCodecs:
    """One pipeline rank's codec state: both directions on both of its boundaries.

    Args:
        cfg: the validated ``PPQConfig``.
        pp_rank, pp_size: this rank's position in the pipeline (names the boundaries in messages).

    Attributes:
        steps: training steps seen (``warmup_steps`` of them travel uncompressed).
        raw_bytes, wire_bytes: what the logical tensors and what the payloads this rank sent would
            weigh / weighed, per direction (``"activations"``, ``"gradients"``).
    """

    def __init__(self, cfg: PPQConfig, pp_rank: int, pp_size: int):
        self.cfg = cfg
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.steps = 0
        self.raw_bytes = {"activations": 0, "gradients": 0}
        self.wire_bytes = {"activations": 0, "gradients": 0}
        nxt, prv = (pp_rank + 1) % pp_size, (pp_rank - 1) % pp_size
        self.act_send = self._codec(cfg.activations, "encoder", f"activations stage {pp_rank}->{nxt}")
        self.act_recv = self._codec(cfg.activations, "decoder", f"activations stage {prv}->{pp_rank}")
        self.grad_send = self._codec(cfg.gradients, "encoder", f"gradients stage {pp_rank}->{prv}")
        self.grad_recv = self._codec(cfg.gradients, "decoder", f"gradients stage {nxt}->{pp_rank}")
        self.reuse = cfg.gradients.method == "topk" and cfg.gradients.reuse_indices
        self.sent_indices: deque = deque()  # TopK indices of activations sent, per micro-batch
        self.recv_indices: deque = deque()  # TopK indices of activations received, per micro-batch

    def _codec(self, c: CodecConfig, kind: str, name: str):
        if not c.enabled:
            return None
        from deepspeed_ppq.compress import BoundaryDecoder, BoundaryEncoder

        direction = name.split()[0]
        if kind == "encoder":
            return BoundaryEncoder(c, name=name, nonfinite=self.cfg.nonfinite, direction=direction)
        return BoundaryDecoder(c, name=name, direction=direction)

    def active(self, direction: str, training: bool) -> bool:
        """Whether ``direction`` goes through its codec on this call (same answer on both ends).

        Warm-up steps and evaluation without ``eval_compressed`` send the tensor itself.
        """
        c: CodecConfig = getattr(self.cfg, direction)
        if not c.enabled:
            return False
        if training:
            return self.steps >= self.cfg.warmup_steps
        return c.eval_compressed

    def payload_nbytes(self, direction: str, shape, dtype: torch.dtype, training: bool) -> int:
        """Bytes of the payload the other end sends in ``direction`` for a tensor of ``shape``."""
        side = self.act_recv if direction == "activations" else self.grad_recv
        return int(side.nbytes(tuple(shape), dtype, training=training))

    # -- the four directions ------------------------------------------------------------------------
    def encode_activation(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        payload = self.act_send.encode(x.detach(), training=training)
        if training and self.reuse:
            self.sent_indices.append(self.act_send.last_indices)
        self._count("activations", x, payload)
        return payload  # the encoder allocates it on x's device

    def decode_activation(self, payload, out: torch.Tensor, training: bool) -> None:
        self.act_recv.decode(payload, tuple(out.shape), out.dtype, training=training, out=out)
        if training and self.reuse:
            self.recv_indices.append(self.act_recv.last_indices)

    def encode_gradient(self, g: torch.Tensor, training: bool) -> torch.Tensor:
        indices = self._pop(self.recv_indices, "received activation") if self.reuse and training else None
        payload = self.grad_send.encode(g.detach().contiguous(), training=training, indices=indices)
        self._count("gradients", g, payload)
        return payload

    def decode_gradient(self, payload, out: torch.Tensor, training: bool) -> None:
        indices = self._pop(self.sent_indices, "sent activation") if self.reuse and training else None
        self.grad_recv.decode(payload, tuple(out.shape), out.dtype, training=training, indices=indices,
                              out=out)

    def _pop(self, queue: deque, what: str):
        if not queue:
            raise RuntimeError(f"ppq: a gradient is crossing a boundary but no {what}'s TopK indices are "
                               "kept for it (gradients out of forward order?)")
        return queue.popleft()

    def _count(self, direction: str, x: torch.Tensor, payload: torch.Tensor) -> None:
        self.raw_bytes[direction] += x.numel() * x.element_size()
        self.wire_bytes[direction] += payload.numel() * payload.element_size()

    def count_raw(self, direction: str, x: torch.Tensor) -> None:
        n = x.numel() * x.element_size()
        self.raw_bytes[direction] += n
        self.wire_bytes[direction] += n


class _DecodeOnWait:
    """A receive request whose ``wait()`` also decodes the payload into the schedule's tensor."""

    def __init__(self, req, finish: Callable[[], None]):
        self._req, self._finish, self._done = req, finish, False

    def wait(self):
        self._req.wait()
        if not self._done:
            self._done = True
            self._finish()
        return True

    def is_completed(self) -> bool:
        return self._done or self._req.is_completed()


class _KeepAlive:
    """A send request that holds its payload until the transfer is waited on."""

    def __init__(self, req, payload: torch.Tensor):
        self._req, self._payload = req, payload

    def wait(self):
        out = self._req.wait()
        self._payload = None
        return out

    def is_completed(self) -> bool:
        return self._req.is_completed()


class PPQP2PCommunicator(_p2p.P2PCommunicator):
    """megatron-core's ``P2PCommunicator`` with codec payloads on the wire.

    Args:
        pp_group: the pipeline-parallel process group.
        config: the model's ``ModelParallelConfig``/``TransformerConfig`` (``pipeline_dtype``,
            ``batch_p2p_comm``, ...).
        ppq: a ``PPQConfig`` (or dict/JSON path); its ``activations`` and ``gradients`` codecs are used.
        codecs: an existing :class:`BoundaryCodecs` to share (the installed patch passes one so that
            state survives the schedule building a new communicator every step).
    """

    ppq_config: PPQConfig | None = None  # set on the subclass bound by install_compressed_p2p
    shared_codecs: dict | None = None

    def __init__(self, pp_group: dist.ProcessGroup, config, ppq=None, codecs: BoundaryCodecs | None = None):
        super().__init__(pp_group, config)
        if codecs is None:
            cfg = load_ppq_config(ppq if ppq is not None else type(self).ppq_config)
            key = (tuple(dist.get_process_group_ranks(pp_group)), pp_group.rank())
            shared = type(self).shared_codecs
            if shared is not None and key in shared:
                codecs = shared[key]
            else:
                codecs = BoundaryCodecs(cfg, pp_group.rank(), pp_group.size())
                if shared is not None:
                    shared[key] = codecs
        if config.use_ring_exchange_p2p and (codecs.cfg.activations.enabled or codecs.cfg.gradients.enabled):
            raise ValueError("use_ring_exchange_p2p=True bypasses the compressed send/recv: set it to "
                             "False to use ppq activations/gradients codecs")
        self.codecs = codecs

    @property
    def training(self) -> bool:
        ctx = _CALL.get()
        return True if ctx is None else ctx.training

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        config = self.config
        codecs = self.codecs
        ctx = _CALL.get()
        if ctx is not None:
            ctx.touched.add(codecs)
        training = self.training
        if config.variable_seq_lengths or config.mtp_standalone:
            recv_prev_shape, recv_next_shape = self._communicate_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        else:
            recv_prev_shape = recv_next_shape = tensor_shape
        if (recv_prev or recv_next) and config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive a tensor")
        if (recv_prev or recv_next) and tensor_shape is None:
            raise RuntimeError("tensor_shape must be specified to receive a tensor, "
                               "e.g. (seq_length, micro_batch_size, hidden_size)")
        act_on = codecs.active("activations", training)
        grad_on = codecs.active("gradients", training)
        device = _device()

        # What goes on the wire: payloads for compressed directions, the tensors themselves otherwise.
        wire_send_next, wire_send_prev = tensor_send_next, tensor_send_prev
        if tensor_send_next is not None:
            if act_on:
                wire_send_next = codecs.encode_activation(tensor_send_next, training)
            else:
                codecs.count_raw("activations", tensor_send_next)
        if tensor_send_prev is not None:
            if grad_on:
                wire_send_prev = codecs.encode_gradient(tensor_send_prev, training)
            else:
                codecs.count_raw("gradients", tensor_send_prev)

        tensor_recv_prev = tensor_recv_next = None
        wire_recv_prev = wire_recv_next = None
        if recv_prev:
            tensor_recv_prev = torch.empty(recv_prev_shape, requires_grad=True, device=device,
                                           dtype=config.pipeline_dtype)
            wire_recv_prev = (torch.empty(codecs.payload_nbytes("activations", recv_prev_shape,
                                                                config.pipeline_dtype, training),
                                          dtype=torch.uint8, device=device) if act_on else tensor_recv_prev)
        if recv_next:
            tensor_recv_next = torch.empty(recv_next_shape, requires_grad=True, device=device,
                                           dtype=config.pipeline_dtype)
            wire_recv_next = (torch.empty(codecs.payload_nbytes("gradients", recv_next_shape,
                                                                config.pipeline_dtype, training),
                                          dtype=torch.uint8, device=device) if grad_on else tensor_recv_next)

        def finish_prev():
            codecs.decode_activation(wire_recv_prev, tensor_recv_prev, training)

        def finish_next():
            codecs.decode_gradient(wire_recv_next, tensor_recv_next, training)

        if config.batch_p2p_comm:
            if not wait_on_reqs:
                raise RuntimeError("batch_p2p_comm=True needs wait_on_reqs=True (as in megatron-core)")
            p2p_func = _p2p._batched_p2p_ops
        else:
            p2p_func = _p2p._p2p_ops
        reqs = p2p_func(tensor_send_prev=wire_send_prev, tensor_recv_prev=wire_recv_prev,
                        tensor_send_next=wire_send_next, tensor_recv_next=wire_recv_next,
                        group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                        next_pipeline_rank=self.next_rank)
        if wait_on_reqs:
            for req in reqs if isinstance(reqs, list) else reqs.values():
                req.wait()
            reqs = None
            if recv_prev and act_on:
                finish_prev()
            if recv_next and grad_on:
                finish_next()
        else:  # deferred: decode when the schedule waits on the receive (unbatched p2p only)
            if "recv_prev" in reqs and act_on:
                reqs["recv_prev"] = _DecodeOnWait(reqs["recv_prev"], finish_prev)
            if "recv_next" in reqs and grad_on:
                reqs["recv_next"] = _DecodeOnWait(reqs["recv_next"], finish_next)
            if "send_next" in reqs and act_on:
                reqs["send_next"] = _KeepAlive(reqs["send_next"], wire_send_next)
            if "send_prev" in reqs and grad_on:
                reqs["send_prev"] = _KeepAlive(reqs["send_prev"], wire_send_prev)
        if config.batch_p2p_comm and config.batch_p2p_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return tensor_recv_prev, tensor_recv_next, reqs


def _wrap_schedule(func: Callable) -> Callable:
    """A schedule function that tells the communicator training from evaluation and counts steps."""
    if getattr(func, "_ppq_wrapped", False):
        return func

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        ctx = _CallContext(training=not kwargs.get("forward_only", False))
        token = _CALL.set(ctx)
        try:
            out = func(*args, **kwargs)
        finally:
            _CALL.reset(token)
        if ctx.training:
            for codecs in ctx.touched:
                codecs.steps += 1
        return out

    wrapped._ppq_wrapped = True
    wrapped._ppq_original = func
    return wrapped


def ppq_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None) -> Callable:
    """``megatron.core.pipeline_parallel.get_forward_backward_func`` whose schedule tracks ppq state.

    Use it with ``p2p_communicator=PPQP2PCommunicator(...)`` and ``pg_collection=``.
    """
    return _wrap_schedule(_schedules.get_forward_backward_func(pp_size, vp_size))


_SCHEDULE_NAMES = ("forward_backward_pipelining_without_interleaving",
                   "forward_backward_pipelining_with_interleaving")
_SAVED: dict = {}


def install_compressed_p2p(cfg: PPQConfig | dict | str) -> type[PPQP2PCommunicator]:
    """Make megatron-core's schedules use compressed P2P when they build their own communicator.

    Swaps ``schedules.P2PCommunicator`` for a :class:`PPQP2PCommunicator` subclass bound to ``cfg``
    (one codec state per pipeline rank, kept across steps) and wraps the two pipelined schedule
    functions that ``get_forward_backward_func`` returns. Idempotent; undone by
    :func:`uninstall_compressed_p2p`.

    Returns:
        The bound communicator class.

    Raises:
        RuntimeError: on an untested megatron-core version (see ``megatron_patches._compat``).
    """
    check_megatron_version("compressed P2P")
    cfg = load_ppq_config(cfg)
    if not _SAVED:
        _SAVED["P2PCommunicator"] = _schedules.P2PCommunicator
        for name in _SCHEDULE_NAMES:
            _SAVED[name] = getattr(_schedules, name)
    bound = type("BoundPPQP2PCommunicator", (PPQP2PCommunicator,), {"ppq_config": cfg, "shared_codecs": {}})
    _schedules.P2PCommunicator = bound
    for name in _SCHEDULE_NAMES:
        setattr(_schedules, name, _wrap_schedule(_SAVED[name]))
    return bound


def bytes_on_wire() -> dict[str, tuple[int, int]]:
    """What this process sent across each pipeline boundary through the installed communicator.

    Returns:
        ``{"activations stage 0->1": (raw_bytes, wire_bytes), "gradients stage 1->0": ...}``: the
        logical tensors' bytes and the bytes actually sent, per boundary and direction this rank sends
        (empty when :func:`install_compressed_p2p` is not in effect or nothing was sent).
    """
    shared = getattr(_schedules.P2PCommunicator, "shared_codecs", None) or {}
    out: dict[str, tuple[int, int]] = {}
    for codecs in shared.values():
        r, n = codecs.pp_rank, codecs.pp_size
        for direction, peer in (("activations", r + 1), ("gradients", r - 1)):
            if codecs.raw_bytes[direction]:
                out[f"{direction} stage {r}->{peer % n}"] = (codecs.raw_bytes[direction],
                                                            codecs.wire_bytes[direction])
    return out


def format_bytes_on_wire(counts: dict[str, tuple[int, int]]) -> list[str]:
    """One line per boundary: ``activations stage 0->1: 327,680 -> 51,360 bytes (6.38x)``."""
    return [f"{name}: {raw:,} -> {wire:,} bytes ({raw / wire:.2f}x)" for name, (raw, wire) in counts.items()]


def uninstall_compressed_p2p() -> None:
    """Put megatron-core's own communicator and schedule functions back."""
    for name, value in _SAVED.items():
        setattr(_schedules, name, value)
    _SAVED.clear()
