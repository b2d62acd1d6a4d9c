"""How ``PPQPipelineEngine`` moves payloads between stages (a mixin): reused buffers, sends that overlap
the next instruction, and the watchdog told what the engine waits for.

Receive buffers are one per (direction, tuple index, size): ``p2p.recv`` fills them and the channel decodes
out of them before the next receive. Send buffers are one per (direction, tuple index, size, micro-batch
buffer), so sends of different micro-batches can be in flight together; before a send buffer is encoded
into again, its previous send is waited for, and a schedule ends with nothing in flight.
"""

from __future__ import annotations

import functools
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import p2p

__all__ = ["TransportMixin", "watched"]


def watched(method, what: str):
    """``method`` (an instruction) with the watchdog told what it waits for while it runs."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._watch is None:
            return method(self, *args, **kwargs)
        buffer_id = args[0] if args else kwargs.get("buffer_id", "-")
        self._watch.waiting(what.format(prev=self.stage_id - 1, next=self.stage_id + 1, buffer_id=buffer_id))
        out = method(self, *args, **kwargs)
        self._watch.progress()
        return out

    return run


class TransportMixin:
    """Payload buffers, overlapped sends and watchdog notes for ``PPQPipelineEngine``."""

    def _init_transport(self, overlap_sends: bool) -> None:
        self._payload_bufs: dict[tuple, torch.Tensor] = {}
        self._overlap = overlap_sends and p2p.can_send_recv()
        self._inflight: dict[tuple, object] = {}  # send buffer key -> the isend's work handle
        self._watch = None
        if self.is_pipe_parallel and self.ppq.watchdog_timeout_s > 0:
            from deepspeed_ppq.integrations.watchdog import Watchdog

            self._watch = Watchdog(self.ppq.watchdog_timeout_s, self.stage_id, self.global_rank)
            # its thread stops with the engine (one process may build many: the tuner's trials)
            weakref.finalize(self, self._watch.close)

    def _buffer(self, key: tuple, shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        buf = self._payload_bufs.get(key)
        if buf is None:
            buf = self._payload_bufs[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _recv_payload(self, direction: str, idx: int, nbytes: int, stage: int) -> torch.Tensor:
        """Receive a payload of ``nbytes`` into the reused buffer of (direction, tuple index, size)."""
        buf = self._buffer((direction, idx, nbytes), nbytes)
        p2p.recv(buf, stage)
        return buf

    def _send_buffer(self, direction: str, idx: int, nbytes: int, buffer_id: int) -> torch.Tensor:
        """The payload buffer to encode into for micro-batch buffer ``buffer_id``; waits for its last send.
        Blocking ``p2p.send`` returns once the tensor is handed over (gloo) or enqueued on the communication
        stream (NCCL), so without overlap one buffer per (direction, tuple index, size) suffices."""
        self._wait_send((direction, idx, nbytes, buffer_id))
        owner = f"send_{direction}_{buffer_id}" if self._overlap else f"send_{direction}"
        return self._buffer((owner, idx, nbytes), nbytes)

    def _send_payload(self, payload: torch.Tensor, stage: int, direction: str, idx: int,
                      buffer_id: int) -> None:
        if not self._overlap:
            p2p.send(payload, stage)
            return
        key = (direction, idx, payload.numel(), buffer_id)
        self._inflight[key] = dist.isend(payload, self.grid.stage_to_global(stage_id=stage))

    def _wait_send(self, key: tuple) -> None:
        work = self._inflight.pop(key, None)
        if work is not None:
            work.wait()

    def _wait_sends(self) -> None:
        """Wait for every payload still in flight."""
        for key in list(self._inflight):
            self._wait_send(key)

    def _exec_schedule(self, *args, **kwargs):
        try:
            return super()._exec_schedule(*args, **kwargs)
        finally:
            self._wait_for("the last sends of the schedule to complete")
            self._wait_sends()  # a schedule (train or eval batch) ends with nothing in flight
            self._done_waiting()

    def _wait_for(self, what: str) -> None:
        if self._watch is not None:
            self._watch.waiting(what)

    def _done_waiting(self, idle: bool = False, step_seconds: float | None = None) -> None:
        if self._watch is not None:
            if idle:
                self._watch.idle(step_seconds)
            else:
                self._watch.progress()
