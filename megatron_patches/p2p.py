"""Compressed stage-to-stage traffic inside megatron-core's own pipeline schedules.

Every P2P call of megatron-core 0.16.1 and 0.19.2 (``recv_forward``, ``send_forward_recv_backward``, ...) goes
through one method, ``P2PCommunicator._communicate``. :class:`PPQP2PCommunicator` overrides it: the
activation sent to the next stage and the gradient sent to the previous one cross through a
``deepspeed_ppq.compress.BoundaryChannel`` each (the same as DeepSpeed's engine: when to compress,
codec state, TopK index reuse, AQ-SGD, non-finite checks, counters) as the codec's flat ``uint8``
payload; the receiver allocates the payload's exact size (fixed per shape, dtype and codec, so nothing
extra is exchanged) and decodes into the logical tensor the schedule expects.

Two ways in:

- Megatron-LM's training loop builds ``P2PCommunicator(pp_group=..., config=...)`` from the
  module-global name in ``megatron.core.pipeline_parallel.schedules`` on every step.
  :func:`install_compressed_p2p` swaps that name for a subclass bound to one shared codec state
  (error-feedback buffers live across steps) and wraps the schedule functions so the communicator
  knows training from evaluation (``forward_only``) and counts steps (``warmup_steps``).
- megatron-core users pass ``p2p_communicator=PPQP2PCommunicator(pp_group, config, ppq=cfg)`` together
  with ``pg_collection=`` to a schedule from :func:`ppq_forward_backward_func`.

State per rank and per schedule call: ``p2p_state`` (:class:`BoundaryCodecs`: the two channels, the
micro-batch numbering that pairs each gradient with its activation, the sample ids of AQ-SGD).

AQ-SGD: each training batch carries its samples' dataset indices, as on DeepSpeed: ``(inputs, labels,
sample_ids)``, or a dict with a ``"sample_ids"`` entry. With ``ppq.aqsgd.enabled`` the wrapped schedule
takes them off every batch before ``forward_step_func`` sees it; the first stage sends each micro-batch's
ids in front of its activation payload (``int64[B]``, counted as side bytes) and later stages forward them.

Deferred decoding: with ``batch_p2p_comm=False`` the interleaved schedule asks for the requests back
(``wait_on_reqs=False``) and waits on them later. The receive requests are then wrapped so that
``wait()`` finishes the transfer and decodes the payload into the tensor already handed to the
schedule; send requests keep their payload alive until they complete.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import p2p_communication as _p2p
from megatron.core.pipeline_parallel import schedules as _schedules

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config

from .args import interleaving_problems
from .compat import check_megatron_version, check_patch_points
from .p2p_state import _CALL, BoundaryCodecs, _CallContext, device, evaluating, with_sample_ids

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

    Raises:
        PPQConfigError: settings the interleaved schedule (``virtual_pipeline_model_parallel_size``)
            cannot carry, or ``use_ring_exchange_p2p`` with a codec.
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
        cfg = codecs.cfg
        if config.use_ring_exchange_p2p and (cfg.activations.enabled or cfg.gradients.enabled):
            raise ValueError("use_ring_exchange_p2p=True bypasses the compressed send/recv: set it to "
                             "False to use ppq activations/gradients codecs")
        vp = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
        problems = interleaving_problems(cfg) if vp > 1 else []
        if problems:
            raise PPQConfigError("ppq settings the interleaved schedule cannot carry:\n  "
                                 + "\n  ".join(problems))
        self.codecs = codecs
        if codecs.skips_steps:  # ppq.nonfinite="skip": the optimizer step settles each step (optim.py)
            from .optim import install_step_hooks

            install_step_hooks()

    @property
    def training(self) -> bool:
        ctx = _CALL.get()
        return True if ctx is None else ctx.training

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        config, codecs, ctx = self.config, self.codecs, _CALL.get()
        if ctx is not None and codecs not in ctx.touched:
            ctx.touched.add(codecs)
            codecs.begin_schedule(ctx.training)
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
        # What goes on the wire: payloads for compressed directions, the tensors themselves otherwise.
        wire_send_next = None if tensor_send_next is None else codecs.send("activations", tensor_send_next,
                                                                             training)
        wire_send_prev = None if tensor_send_prev is None else codecs.send("gradients", tensor_send_prev,
                                                                             training)
        received = {}
        for name, wanted, direction, shape in (("recv_prev", recv_prev, "activations", recv_prev_shape),
                                               ("recv_next", recv_next, "gradients", recv_next_shape)):
            if wanted:
                received[name] = codecs.receive(direction, shape, config.pipeline_dtype, device(), training)
        (tensor_recv_prev, wire_recv_prev, _), (tensor_recv_next, wire_recv_next, _) = (
            received.get(k, (None, None, None)) for k in ("recv_prev", "recv_next"))

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
            for _, _, finish in received.values():
                finish()
        else:  # deferred: decode when the schedule waits on the receive (unbatched p2p only)
            for name, (_, _, finish) in received.items():
                reqs[name] = _DecodeOnWait(reqs[name], finish)
            for name, wire, sent in (("send_next", wire_send_next, tensor_send_next),
                                     ("send_prev", wire_send_prev, tensor_send_prev)):
                if name in reqs and wire is not sent:
                    reqs[name] = _KeepAlive(reqs[name], wire)
        codecs.raise_if_flagged()  # a flagged payload this rank sent is out: stop (ppq.nonfinite="error")
        if config.batch_p2p_comm and config.batch_p2p_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return tensor_recv_prev, tensor_recv_next, reqs


def _config_of(kwargs: dict) -> PPQConfig | None:
    """The ppq settings a schedule call runs with: its communicator's, or the installed patch's."""
    comm = kwargs.get("p2p_communicator")
    if isinstance(comm, PPQP2PCommunicator):
        return comm.codecs.cfg
    return getattr(_schedules.P2PCommunicator, "ppq_config", None)


def _wrap_schedule(func: Callable) -> Callable:
    """A schedule function that tells the communicator training from evaluation, hands it the batches'
    sample ids (AQ-SGD) and counts steps."""
    if getattr(func, "_ppq_wrapped", False):
        return func

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        ctx = _CallContext(training=not kwargs.get("forward_only", False))
        cfg = _config_of(kwargs)
        if cfg is not None and cfg.aqsgd.enabled and kwargs.get("data_iterator") is not None:
            kwargs["data_iterator"] = with_sample_ids(kwargs["data_iterator"], ctx)
        token = _CALL.set(ctx)
        done = False
        try:
            out = func(*args, **kwargs)
            done = True
        finally:
            _CALL.reset(token)
            for codecs in ctx.touched:
                codecs.end_schedule(ctx.training, done)
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
    functions that ``get_forward_backward_func`` returns; with ``ppq.nonfinite="skip"`` the optimizer
    step hooks (``megatron_patches.optim``) skip a step NaN/Inf crossed a boundary in on every rank.
    Idempotent; undone by :func:`uninstall_compressed_p2p` (the step hooks stay: they do nothing
    without a pending step).

    Returns:
        The bound communicator class.

    Raises:
        RuntimeError: on an untested megatron-core version (see ``megatron_patches.compat``).
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
    if cfg.nonfinite == "skip":
        from .optim import install_step_hooks

        install_step_hooks()
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
