"""Compressed stage-to-stage traffic inside DeepSpeed's ``PipelineEngine``.

``initialize(...)`` is a drop-in for ``deepspeed.initialize``: it reads the top-level ``"ppq"`` section
of the DeepSpeed config and, for a ``PipelineModule``, builds a ``PPQPipelineEngine``. That subclass
replaces the four p2p instructions of DeepSpeed's schedule (send/recv of activations and gradients);
everything else (schedules, data loading, optimizer, checkpoints) is stock DeepSpeed.

Wire protocol, per micro-batch and boundary ``b`` (stage ``b`` -> ``b+1``):

* the logical shapes and dtypes go once, through DeepSpeed's own tensor meta (``_send_tensor_meta``);
  each side then computes the payload size with ``payload_nbytes`` -- no per-step metadata;
* activations: ``[sample_ids int64[B] (AQ-SGD only)]`` then, for each tensor of the output tuple, a
  flat uint8 payload (floating tensors) or the tensor itself (integer/bool tensors, uncompressed);
* gradients: one uint8 payload per floating tensor of the tuple, in order.

Per-boundary state (EF, EF21, AQ-SGD buffers) lives in one ``BoundaryEncoder``/``BoundaryDecoder`` per
(boundary, direction, tuple index). TopK index reuse is keyed by the micro-batch buffer: stage ``b`` keeps
the indices it chose for the activation in buffer ``i``, stage ``b+1`` keeps the ones it decoded, and the
gradient for that buffer travels as values only.

Stage options (``initialize``'s ``block_layers``/``recompute_stages``/``recompute_layers``/``requantize``;
see ``integrations.stage`` and docs/deepspeed.md "API"): ``ppq.weights`` converts each stage's Linear
layers with global block indices, chosen stages recompute their block layers, and train-mode
``QuantLinear`` compute copies are re-quantized after every optimizer step. Counters (``ppq_stats``)
cover DeepSpeed's own uncompressed sends as well, so a baseline's bytes are measured.

Start-up: adjacent stages exchange their codec settings and partition (boundaries, layer and stage count;
JSON + SHA-256) and both stop with an error naming the differing fields if they disagree.
Non-finite values are checked on every path (compressed, warm-up, evaluation) when a codec is configured:
with ``ppq.nonfinite="error"`` the sender flags the payload and raises, the receiver sees the flag (or the
raw NaN/Inf) and raises too (both name the stage and boundary); with ``"skip"`` the receiver decodes NaN,
all ranks all-reduce a flag before the optimizer step and skip it together, and the codec state
(EF/EF21/AQ-SGD) returns to where the step found it. Codec "none" everywhere is stock DeepSpeed.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from deepspeed_ppq.config import CodecConfig, PPQConfig, PPQConfigError, load_ppq_config
from deepspeed_ppq.integrations.ds_setup import (
    _check_sample_ids,
    _optimizer_8bit,
    _prepare_model,
    _resolve_ds_config,
    _wire_requantize,
    check_codecs,
)
from deepspeed_ppq.integrations.handshake import CodecMismatchError, HandshakeMixin, codec_settings
from deepspeed_ppq.integrations.nonfinite import NonFiniteMixin, NonFiniteStepError
from deepspeed_ppq.integrations.shm import release_at_exit

# DeepSpeed's CPU backend leaves a /dev/shm buffer per rank from init_distributed on: registered for removal
# at exit as soon as this module is imported, so a script that fails before initialize() leaves none.
release_at_exit()

__all__ = ["initialize", "PPQPipelineEngine", "CodecMismatchError", "NonFiniteStepError", "codec_settings",
           "check_codecs"]

_DIRECTIONS = ("act", "grad")
_STAT_FIELDS = ("raw_bytes", "wire_bytes", "side_bytes", "messages", "encode_s", "decode_s")


def _own(x):
    """A copy of ``x`` (tensor or tuple of tensors) that no reused buffer aliases."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_own(v) for v in x)
    return x


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _watched(method, what: str):
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


class PPQPipelineEngine(HandshakeMixin, NonFiniteMixin, PipelineEngine):
    """``PipelineEngine`` whose activations and gradients cross stage boundaries compressed.

    Built by ``deepspeed_ppq.initialize``; takes the ``PipelineEngine`` arguments plus:

    Args:
        ppq_config: the ``"ppq"`` section (``PPQConfig``, dict, path or ``None``).
        ppq_sample_ids: the data iterator yields ``(inputs, labels, sample_ids)`` batches (needed by
            AQ-SGD; implied when ``training_data`` items are 3-tuples).
        ppq_overlap_sends: compressed payloads leave with a non-blocking ``isend``; the engine goes on
            with its next instruction and waits for the send only before it reuses that payload buffer
            (one per micro-batch buffer) and at the end of the schedule. The bytes are the same, so the
            numbers are too; only the waiting moves.
    """

    def __init__(self, *args, ppq_config: PPQConfig | dict | str | None = None,
                 ppq_sample_ids: bool | None = None, ppq_overlap_sends: bool = True, **kwargs):
        self.ppq = load_ppq_config(ppq_config)
        self._aqsgd = self.ppq.aqsgd.enabled
        if self._aqsgd:
            _check_sample_ids(kwargs.get("training_data"), ppq_sample_ids)
        check_codecs(self.ppq)  # on every rank before any communication: no rank waits on a failed one
        super().__init__(*args, **kwargs)
        if self._config.pipeline.get("recompute_stages") is not None and \
                self.module.activation_checkpoint_interval > 0:
            # pipeline.recompute_stages (per stage) replaces activation_checkpoint_interval (all stages)
            self.module.activation_checkpoint_interval = 0
        self._compressing = self.ppq.activations.enabled or self.ppq.gradients.enabled
        if self._compressing and (self.is_pipe_partitioned or self.has_bool_tensors):
            raise NotImplementedError(
                "ppq compression does not support pipe_partitioned/grad_partitioned (tensor parallel > 1) "
                "or has_bool_tensors; set ppq.activations.method and ppq.gradients.method to 'none'"
            )
        self._encoders: dict[tuple[str, int], Any] = {}
        self._decoders: dict[tuple[str, int], Any] = {}
        self._payload_bufs: dict[tuple, torch.Tensor] = {}
        self._overlap = ppq_overlap_sends and p2p.can_send_recv()
        self._inflight: dict[tuple, Any] = {}  # send buffer key -> the isend's work handle
        self._sent_indices: dict[int, dict[int, Any]] = {}  # buffer -> tuple index -> TopK indices
        self._recv_indices: dict[int, dict[int, Any]] = {}
        self._sample_ids: dict[int, torch.Tensor] = {}  # buffer -> int64[B]
        self._pending_ids: torch.Tensor | None = None
        self._nonfinite_where: list[str] = []
        self._step_open = False  # codec state updates of this step can be rolled back (nonfinite="skip")
        self._stats = {(b, d): dict.fromkeys(_STAT_FIELDS, 0.0)
                       for b in range(self.num_stages - 1) for d in _DIRECTIONS}
        self._watch = None
        if self.is_pipe_parallel and self.ppq.watchdog_timeout_s > 0:
            from deepspeed_ppq.integrations.watchdog import Watchdog

            self._watch = Watchdog(self.ppq.watchdog_timeout_s, self.stage_id, self.global_rank)
        if self.is_pipe_parallel:
            self._wait_for(f"the start-up handshake with the neighbouring stages of stage {self.stage_id}")
            self._handshake()
            self._done_waiting(idle=True)

    def _boundary(self, direction: str, sending: bool) -> int:
        """The boundary index this stage talks over for ``direction``."""
        forward = direction == "act"
        return self.stage_id if forward == sending else self.stage_id - 1

    def _codec(self, direction: str) -> CodecConfig:
        return self.ppq.activations if direction == "act" else self.ppq.gradients

    def _name(self, direction: str, boundary: int, idx: int) -> str:
        what = "activations" if direction == "act" else "gradients"
        return f"boundary {boundary} (stage {boundary} -> {boundary + 1}) {what}[{idx}]"

    def _encoder(self, direction: str, idx: int):
        key = (direction, idx)
        if key not in self._encoders:
            from deepspeed_ppq.compress import BoundaryEncoder

            b = self._boundary(direction, sending=True)
            self._encoders[key] = BoundaryEncoder(
                self._codec(direction), name=self._name(direction, b, idx),
                aqsgd=self.ppq.aqsgd if direction == "act" and self._aqsgd else None,
                direction="activations" if direction == "act" else "gradients",
                nonfinite="skip")  # flag it in the payload, so the receiver stops (or skips) too
            if self._step_open:
                self._encoders[key].begin_step()
        return self._encoders[key]

    def _decoder(self, direction: str, idx: int):
        key = (direction, idx)
        if key not in self._decoders:
            from deepspeed_ppq.compress import BoundaryDecoder

            b = self._boundary(direction, sending=False)
            self._decoders[key] = BoundaryDecoder(
                self._codec(direction), name=self._name(direction, b, idx),
                aqsgd=self.ppq.aqsgd if direction == "act" and self._aqsgd else None,
                direction="activations" if direction == "act" else "gradients")
            if self._step_open:
                self._decoders[key].begin_step()
        return self._decoders[key]

    def _payload_buffer(self, direction: str, idx: int, nbytes: int) -> torch.Tensor:
        """A uint8 buffer reused for every message of (``direction``, tuple index, size): receive buffers
        and send buffers alike -- ``p2p.send`` returns once the tensor is handed over (gloo) or enqueued
        on the communication stream (NCCL), so the next encode may overwrite it."""
        key = (direction, idx, nbytes)
        buf = self._payload_bufs.get(key)
        if buf is None:
            buf = self._payload_bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def _send_buffer(self, direction: str, idx: int, nbytes: int, buffer_id: int) -> torch.Tensor:
        """The payload buffer to encode into: one per (direction, tuple index, size, micro-batch buffer),
        so sends of different micro-batches can be in flight together; waits for its previous send."""
        key = (direction, idx, nbytes, buffer_id)
        self._wait_send(key)
        return self._payload_buffer("send_" + direction, idx, nbytes) if not self._overlap else \
            self._payload_buffer(f"send_{direction}_{buffer_id}", idx, nbytes)

    def _send_payload(self, payload: torch.Tensor, stage: int, key: tuple) -> None:
        if not self._overlap:
            p2p.send(payload, stage)
            return
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

    def _grad_buffer(self, idx: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The decoded gradient of output ``idx``, reused across micro-batches as DeepSpeed reuses its
        ``grad_layer``: the backward pass consumes it before the next RecvGrad."""
        key = ("grad_out", idx, shape, dtype)
        buf = self._payload_bufs.get(key)
        if buf is None:
            buf = self._payload_bufs[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _codec_mode(self, direction: str) -> dict | None:
        """How ``direction`` goes over the wire now: ``None`` for DeepSpeed's own (uncompressed) path,
        else the ``training``/``uncompressed`` arguments of encode/decode. Both sides compute the same
        answer from the same settings (checked by the handshake) and step counter."""
        cfg = self._codec(direction)
        if not cfg.enabled:
            return None
        if not self.module.training:
            return {"training": False, "uncompressed": False} if cfg.eval_compressed else None
        if direction == "act" and self._aqsgd:
            # AQ-SGD fills its per-sample buffers during warm-up, so warm-up goes through the codec raw.
            return {"training": True, "uncompressed": self._aqsgd_warm()}
        if self.global_steps < self.ppq.warmup_steps:
            return None
        # During AQ-SGD's own warm-up gradients stay compressed (config.py), except TopK gradients that
        # reuse the activation's indices: a raw activation has none, so they go raw as well (the same
        # rule as compressed_boundary(activations_uncompressed=True)).
        raw = self._aqsgd and self._reuse_indices() and self._aqsgd_warm()
        return {"training": True, "uncompressed": raw}

    def _aqsgd_warm(self) -> bool:
        """Whether this step's activations go raw to fill AQ-SGD's per-sample buffers."""
        return self.global_steps < max(self.ppq.warmup_steps, self.ppq.aqsgd.warmup_steps)

    # ---------------------------------------------------------------- data path
    def _next_batch(self):
        """DeepSpeed's batch; with AQ-SGD on (and only then) a training batch is ``(inputs, labels,
        sample_ids)`` and the third element is taken off as the sample ids. Without AQ-SGD the batch goes
        to DeepSpeed untouched, as with stock DeepSpeed (which ignores elements past the second)."""
        batch = super()._next_batch()
        if not self._aqsgd:
            return batch
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            self._pending_ids = torch.as_tensor(batch[2]).to(self.device, torch.int64).reshape(-1)
            batch = (batch[0], batch[1])
        elif self._aqsgd and self.module.training:
            raise PPQConfigError(
                "ppq.aqsgd.enabled=true: every training batch must be (inputs, labels, sample_ids); "
                f"got a {type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}"
            )
        return batch

    def _exec_load_micro_batch(self, buffer_id):
        self._pending_ids = None
        super()._exec_load_micro_batch(buffer_id)
        if self._pending_ids is not None:
            self._sample_ids[buffer_id] = self._pending_ids

    def _needs_ids(self) -> bool:
        return self._aqsgd and self.module.training

    # ------------------------------------------------------------- activations
    def _count_uncompressed(self, boundary: int, direction: str, tensors) -> None:
        """Count what DeepSpeed's own send path puts on the wire (codec ``none``, warm-up, raw evaluation),
        so an uncompressed baseline's bytes are measured by the same counters."""
        stats = self._stats[(boundary, direction)]
        for t in tensors:
            n = t.numel() * t.element_size()
            if t.is_floating_point():
                stats["raw_bytes"] += n
                stats["wire_bytes"] += n
                stats["messages"] += 1
            else:
                stats["side_bytes"] += n

    def _exec_send_activations(self, buffer_id):
        mode = self._codec_mode("act")
        if mode is None:
            outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
            self._count_uncompressed(self.stage_id, "act", outputs)
            super()._exec_send_activations(buffer_id)
            self._check_raw(outputs, "act", self.stage_id, sender=True)
            return None
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        stats = self._stats[(self.stage_id, "act")]
        ids = None
        if self._needs_ids():
            ids = self._sample_ids.get(buffer_id)
            if ids is None:
                raise PPQConfigError("ppq.aqsgd.enabled=true but this micro-batch came without sample_ids")
            p2p.send(ids, self.next_stage)
            stats["side_bytes"] += ids.numel() * ids.element_size()
        kept = self._sent_indices.setdefault(buffer_id, {})
        for idx, t in enumerate(_as_tuple(outputs)):
            if not t.is_floating_point():
                p2p.send(t, self.next_stage)
                stats["side_bytes"] += t.numel() * t.element_size()
                continue
            enc = self._encoder("act", idx)
            t0 = time.perf_counter()
            out = self._send_buffer("act", idx, enc.nbytes(t.shape, t.dtype, **mode), buffer_id)
            payload = enc.encode(t.detach(), sample_ids=ids, out=out, **mode)
            stats["encode_s"] += time.perf_counter() - t0
            kept[idx] = enc.last_indices
            self._check_flag(enc, "act", self.stage_id, idx, sender=True)
            self._send_payload(payload, self.next_stage, ("act", idx, payload.numel(), buffer_id))
            stats["raw_bytes"] += t.numel() * t.element_size()
            stats["wire_bytes"] += payload.numel()
            stats["messages"] += 1
            self._raise_if_sender_flagged()

    def _exec_recv_activations(self, buffer_id):
        mode = self._codec_mode("act")
        if mode is None:
            super()._exec_recv_activations(buffer_id)
            self._check_raw(_as_tuple(self.pipe_buffers["inputs"][buffer_id]), "act", self.stage_id - 1,
                            sender=False)
            return None
        if self.dynamic_shape or self.pipe_recv_buf is None:
            self.pipe_recv_buf = self._recv_tensor_meta(self.prev_stage)
        logical = _as_tuple(self.pipe_recv_buf)
        b = self.stage_id - 1
        ids = None
        if self._needs_ids():
            ids = torch.empty(self.micro_batch_size, dtype=torch.int64, device=self.device)
            p2p.recv(ids, self.prev_stage)
            self._sample_ids[buffer_id] = ids  # forwarded with this micro-batch's activation
        kept = self._recv_indices.setdefault(buffer_id, {})
        recvd = []
        for idx, buf in enumerate(logical):
            if not buf.is_floating_point():
                p2p.recv(buf, self.prev_stage)
                recvd.append(buf.clone().detach())
                continue
            shape = tuple(buf.shape)
            dec = self._decoder("act", idx)
            payload = self._payload_buffer("act", idx, dec.nbytes(shape, buf.dtype, **mode))
            p2p.recv(payload, self.prev_stage)
            t0 = time.perf_counter()
            x = torch.empty(shape, dtype=buf.dtype, device=self.device)
            dec.decode(payload, shape, buf.dtype, sample_ids=ids, out=x, **mode)
            self._stats[(b, "act")]["decode_s"] += time.perf_counter() - t0
            kept[idx] = _own(dec.last_indices)  # the payload buffer is reused
            self._check_flag(dec, "act", b, idx, sender=False)
            x.requires_grad = True
            recvd.append(x)
        self.pipe_buffers["inputs"][buffer_id] = recvd[0] if isinstance(self.pipe_recv_buf, torch.Tensor) \
            else tuple(recvd)

    # --------------------------------------------------------------- gradients
    def _exec_send_grads(self, buffer_id):
        mode = self._codec_mode("grad")
        if mode is None:
            inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
            grads = [t.grad for t in inputs if t.is_floating_point() and t.grad is not None]
            self._count_uncompressed(self.stage_id - 1, "grad", grads)
            self._recv_indices.pop(buffer_id, None)
            super()._exec_send_grads(buffer_id)
            self._check_raw(grads, "grad", self.stage_id - 1, sender=True)
            return None
        inputs = self.pipe_buffers["inputs"][buffer_id]
        b = self.stage_id - 1
        stats = self._stats[(b, "grad")]
        reuse = self._reuse_indices()
        kept = self._recv_indices.pop(buffer_id, {})
        for idx, t in enumerate(_as_tuple(inputs)):
            if not t.is_floating_point():
                continue
            if t.grad is None:
                raise RuntimeError(f"stage {self.stage_id}: input {idx} of micro-batch buffer {buffer_id} "
                                   "has no gradient to send back")
            enc = self._encoder("grad", idx)
            t0 = time.perf_counter()
            out = self._send_buffer("grad", idx, enc.nbytes(t.grad.shape, t.grad.dtype, **mode), buffer_id)
            if reuse and kept.get(idx) is None and not mode["uncompressed"]:
                # the activation of this micro-batch was flagged: no indices to reuse, so its gradient
                # travels as a flagged payload of the agreed size (the step is skipped or stopped anyway)
                payload = enc.encode_flagged(t.grad.shape, t.grad.dtype, out=out, **mode)
            else:
                payload = enc.encode(t.grad, indices=kept.get(idx) if reuse else None, out=out, **mode)
            stats["encode_s"] += time.perf_counter() - t0
            self._check_flag(enc, "grad", b, idx, sender=True)
            self._send_payload(payload, self.prev_stage, ("grad", idx, payload.numel(), buffer_id))
            stats["raw_bytes"] += t.grad.numel() * t.grad.element_size()
            stats["wire_bytes"] += payload.numel()
            stats["messages"] += 1
            self._raise_if_sender_flagged()
        self.pipe_buffers["inputs"][buffer_id] = None
        self._sample_ids.pop(buffer_id, None)

    def _exec_recv_grads(self, buffer_id):
        mode = self._codec_mode("grad")
        if mode is None:
            self._sent_indices.pop(buffer_id, None)
            super()._exec_recv_grads(buffer_id)
            self._check_raw(_as_tuple(self.grad_layer), "grad", self.stage_id, sender=False)
            return None
        outputs = self.pipe_buffers["outputs"][buffer_id]
        reuse = self._reuse_indices()
        kept = self._sent_indices.pop(buffer_id, {})
        grads = []
        for idx, t in enumerate(_as_tuple(outputs)):
            if not t.is_floating_point():
                continue
            shape = tuple(t.shape)
            dec = self._decoder("grad", idx)
            payload = self._payload_buffer("grad", idx, dec.nbytes(shape, t.dtype, **mode))
            p2p.recv(payload, self.next_stage)
            t0 = time.perf_counter()
            g = self._grad_buffer(idx, shape, t.dtype)
            dec.decode(payload, shape, t.dtype, indices=kept.get(idx) if reuse else None, out=g, **mode)
            self._stats[(self.stage_id, "grad")]["decode_s"] += time.perf_counter() - t0
            self._check_flag(dec, "grad", self.stage_id, idx, sender=False)
            grads.append(g)
        self.grad_layer = grads[0] if isinstance(outputs, torch.Tensor) else grads

    def _reuse_indices(self) -> bool:
        g = self.ppq.gradients
        return g.method == "topk" and g.reuse_indices

    # ------------------------------------------------------------------- stats
    def train_batch(self, data_iter=None):
        self._nonfinite_where.clear()
        t_step = time.perf_counter()
        self._done_waiting()
        self._step_open = self._compressing  # a skipped or failed step rolls its codec state back
        if self._step_open:
            for side in self._codec_sides():
                side.begin_step()
        try:
            loss = super().train_batch(data_iter)
        except BaseException:
            self._ppq_stop_timers()  # so the engine can still be used (say, to save a checkpoint)
            for side in self._codec_sides():
                side.rollback()
            raise
        finally:
            self._step_open = False
            for side in self._codec_sides():
                side.commit()  # no-op after a skip (already rolled back)
            self._done_waiting(idle=True, step_seconds=time.perf_counter() - t_step)
        self._nonfinite_where.clear()
        spp = self.steps_per_print() or 1
        if self.monitor.enabled and self.global_steps % spp == 0:
            stats = self.ppq_stats(all_stages=True)
            if self.global_rank == 0:
                self.monitor.write_events([(f"PPQ/boundary{b}/{d}/{k}", v, self.global_samples)
                                           for (b, d), fields in sorted(stats.items())
                                           for k, v in fields.items()])
        return loss

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's ``save_checkpoint`` plus this rank's codec state and set-up
        (``integrations.codec_state``), so a resume continues bit for bit."""
        from deepspeed_ppq.integrations.codec_state import save_codec_state

        tag = f"global_step{self.global_steps}" if tag is None else tag
        out = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                      save_latest=save_latest, **kwargs)
        save_codec_state(self, save_dir, str(tag))
        return out

    def load_checkpoint(self, load_dir, tag=None, load_module_only=False, **kwargs):
        """DeepSpeed's ``load_checkpoint``; first checks that this run is set up as the saved one
        (partition, codecs, weight format, optimizer; the error names what differs and how to convert),
        then restores the codec state (EF/EF21/AQ-SGD buffers, counters) unless ``load_module_only``."""
        import os

        from deepspeed_ppq.integrations import codec_state as cs

        if tag is None and os.path.isfile(os.path.join(load_dir, "latest")):
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        saved = None
        if tag is not None:
            path = cs.state_file(load_dir, tag, self.global_rank)
            if os.path.isfile(path):
                saved = cs.read_state(path)
                if not load_module_only:
                    cs.check_resume(self, path, saved)
            elif self._compressing and not load_module_only:
                warnings.warn(f"{path} is missing (a checkpoint saved without deepspeed_ppq?): the codec "
                              "state (EF/EF21/AQ-SGD buffers) starts afresh", RuntimeWarning, stacklevel=2)
        out = super().load_checkpoint(load_dir, tag=tag, load_module_only=load_module_only, **kwargs)
        if saved is not None and not load_module_only and out[0] is not None:
            cs.load_codec_state(self, saved)
        return out

    def _ppq_stop_timers(self) -> None:
        for timer in getattr(self.timers, "timers", {}).values():
            if getattr(timer, "started_", False):
                timer.stop()

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's ``eval_batch``; a non-finite value seen here (``ppq.nonfinite="skip"``) concerns this
        evaluation only and never skips the next training step."""
        self._nonfinite_where.clear()
        self._done_waiting()
        try:
            return super().eval_batch(*args, **kwargs)
        except BaseException:
            self._ppq_stop_timers()
            raise
        finally:
            self._nonfinite_where.clear()
            self._done_waiting(idle=True)

    def ppq_stats(self, all_stages: bool = False) -> dict[tuple[int, str], dict[str, float]]:
        """Counters per ``(boundary, "act" | "grad")``: raw and on-wire bytes, side-channel bytes
        (sample ids, integer tensors), messages, encode and decode seconds. Messages that go through
        DeepSpeed's own path (codec ``none``, ``ppq.warmup_steps``, evaluation without
        ``eval_compressed``) are counted too, with on-wire bytes equal to raw bytes, so an uncompressed
        baseline's traffic is measured, not computed.

        Args:
            all_stages: sum over the pipeline group (a collective: every stage must call it); without
                it each rank reports what it sent (bytes, encode time) and received (decode time).
        """
        keys = sorted(self._stats)
        if not all_stages:
            return {k: dict(self._stats[k]) for k in keys}
        vec = torch.tensor([[self._stats[k][f] for f in _STAT_FIELDS] for k in keys],
                           dtype=torch.float64, device=self.device)
        if vec.numel():
            dist.all_reduce(vec, group=self.grid.get_pipe_parallel_group())
        return {k: dict(zip(_STAT_FIELDS, row.tolist())) for k, row in zip(keys, vec.cpu())}

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.OptimizerStep: _watched(NonFiniteMixin._exec_optimizer_step,
                                         "the optimizer step's all-reduce over every stage"),
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.SendActivation: _watched(_exec_send_activations, "stage {next} to receive activations "
                                                                  "(SendActivation, buffer {buffer_id})"),
        schedule.RecvActivation: _watched(_exec_recv_activations, "activations from stage {prev} "
                                                                  "(RecvActivation, buffer {buffer_id})"),
        schedule.SendGrad: _watched(_exec_send_grads, "stage {prev} to receive gradients (SendGrad, buffer "
                                                      "{buffer_id})"),
        schedule.RecvGrad: _watched(_exec_recv_grads, "gradients from stage {next} (RecvGrad, buffer "
                                                      "{buffer_id})"),
    }


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None, *,
               sample_ids: bool | None = None, block_layers=None, recompute_stages=None,
               recompute_layers=None, requantize: bool = True, overlap_sends: bool = True, plan=None):
    """Drop-in for ``deepspeed.initialize`` that honours the config's top-level ``"ppq"`` section.

    Before DeepSpeed sees the model: ``ppq.weights`` converts its ``nn.Linear`` layers (skipped when the
    model already holds ``QuantLinear`` layers, e.g. a ``PPQPipelineModule`` built with ``weights=``),
    deciding "first/last N blocks" with global layer indices; the listed stages recompute their block
    layers. After: train-mode ``QuantLinear`` compute copies are re-quantized after every optimizer step
    (``quant.requantize_after_step`` on the engine; its handle is ``engine.ppq_requantize_handle``), and
    master-free layers (``weights.master="none"``) are updated by ``quant.attach_master_free`` on every
    rank (``engine.ppq_master_free_handle``).

    Args:
        (as ``deepspeed.initialize``), plus
        sample_ids: the data iterator yields ``(inputs, labels, sample_ids)`` (AQ-SGD needs it when no
            ``training_data`` with 3-tuple items is given).
        block_layers: global indices of the transformer blocks (default: the module's, or inferred).
        recompute_stages: ``True``, one bool per stage, or stage indices; default: the DeepSpeed config's
            ``pipeline.recompute_stages`` (stage indices, as the autotuner writes them), which then also
            turns DeepSpeed's ``activation_checkpoint_interval`` off (it is one value for all stages).
        recompute_layers: one bool per global layer instead.
        requantize: wire the re-quantization hook (set False if you call ``requantize_after_step`` yourself).
        overlap_sends: compressed payloads go out with a non-blocking send (``PPQPipelineEngine``).
        plan: a tuned ``Plan`` (or plan file path) to carry out, as the config's ``ppq.plan_file``
            (``integrations.plan_apply``): the model is rebuilt at its boundaries and formats, the
            optimizer in its kind, the batch sizes and codecs set from it.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize``; for a
        ``PipelineModule`` the engine is a ``PPQPipelineEngine``.

    Raises:
        PPQConfigError: a bad ``"ppq"`` section, explicit boundaries the module was not built with,
            AQ-SGD without sample indices, or an optimizer built before ``ppq.weights`` replaced layers.
    """
    from deepspeed_ppq.integrations.capture import capture_initialize

    capture_initialize(dict(args=args, model=model, optimizer=optimizer, training_data=training_data,
                            config=config, config_params=config_params))  # under `ppq tune`: stop here
    release_at_exit()  # DeepSpeed's CPU backend never unlinks its /dev/shm all-reduce buffers

    import deepspeed

    ds_config = _resolve_ds_config(args, config, config_params)
    ppq = load_ppq_config(ds_config.get("ppq"))
    if plan is not None or ppq.plan_file:
        from deepspeed_ppq.integrations.plan_apply import apply_plan

        model, optimizer, ds_config, args = apply_plan(plan if plan is not None else ppq.plan_file, model,
                                                       optimizer, ds_config, args)
        config = ds_config
        ppq = load_ppq_config(ds_config.get("ppq"))
    if model is not None:
        _prepare_model(model, ppq, ds_config, optimizer, model_parameters, block_layers, recompute_stages,
                       recompute_layers)
        if ppq.weights.optimizer_8bit:
            optimizer, ds_config = _optimizer_8bit(model, optimizer, ds_config)
            config = ds_config
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = None  # deepspeed.initialize reads it from args again
    else:
        config = ds_config
    common = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param)
    if not isinstance(model, PipelineModule):
        if ppq.activations.enabled or ppq.gradients.enabled:
            warnings.warn("ppq.activations/gradients compression applies to pipeline stages only; "
                          "the model is not a PipelineModule", stacklevel=2)
        out = deepspeed.initialize(mpu=mpu, **common)
        if requantize:
            _wire_requantize(out[0])
        return out
    if ppq.partition.method == "explicit" and list(model.parts) != list(ppq.partition.boundaries):
        raise PPQConfigError(
            f"ppq.partition.boundaries={ppq.partition.boundaries} but the model was partitioned as "
            f"{list(model.parts)}: build it with PPQPipelineModule.from_config(layers, num_stages, config)")
    if ppq.aqsgd.enabled:
        _check_sample_ids(training_data, sample_ids)
    check_codecs(ppq)
    engine_cls = functools.partial(PPQPipelineEngine, ppq_config=ppq, ppq_sample_ids=sample_ids,
                                   ppq_overlap_sends=overlap_sends)
    saved = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = engine_cls  # deepspeed.initialize looks the class up in its module globals
    try:
        out = deepspeed.initialize(mpu=mpu, **common)
    finally:
        deepspeed.PipelineEngine = saved
    if requantize:
        _wire_requantize(out[0])
    return out
