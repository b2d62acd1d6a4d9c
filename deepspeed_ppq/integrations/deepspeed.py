"""Compressed stage-to-stage traffic inside DeepSpeed's ``PipelineEngine``.

``initialize(...)`` is a drop-in for ``deepspeed.initialize``: it reads the top-level ``"ppq"`` section
of the DeepSpeed config and, for a ``PipelineModule``, builds a ``PPQPipelineEngine``. That subclass
replaces the four p2p instructions of DeepSpeed's schedule (send/recv of activations and gradients);
everything else (schedules, data loading, optimizer, checkpoints) is stock DeepSpeed.

Each stage talks over its boundaries through one ``compress.BoundaryChannel`` each (upstream side for
boundary ``stage``, downstream side for ``stage - 1``): the channel decides whether a direction is
compressed now, owns the codec state (EF, EF21, AQ-SGD buffers), reuses TopK indices keyed by the
micro-batch buffer, flags non-finite values and counts bytes. When it says "not compressed" (codec
``none``, ``ppq.warmup_steps``, evaluation without ``eval_compressed``) DeepSpeed's own send path runs;
codec "none" everywhere is stock DeepSpeed.

Wire protocol, per micro-batch and boundary ``b`` (stage ``b`` -> ``b+1``):

* the logical shapes and dtypes go once, through DeepSpeed's own tensor meta (``_send_tensor_meta``);
  each side then computes the payload size with the channel -- no per-step metadata;
* activations: ``[sample_ids int64[B] (AQ-SGD only)]`` then, for each tensor of the output tuple, a
  flat uint8 payload (floating tensors) or the tensor itself (integer/bool tensors, uncompressed);
* gradients: one uint8 payload per floating tensor of the tuple, in order.

Stage options (``initialize``'s ``block_layers``/``recompute_stages``/``recompute_layers``/``requantize``;
see ``integrations.stage`` and docs/deepspeed.md "API"): ``ppq.weights`` converts each stage's Linear
layers with global block indices, chosen stages recompute their block layers, and train-mode
``QuantLinear`` compute copies are re-quantized after every optimizer step. Counters (``ppq_stats``)
cover DeepSpeed's own uncompressed sends as well, so a baseline's bytes are measured.

Start-up: adjacent stages exchange their codec settings, boundary dtype, partition, precision policy and
plan fingerprint (``integrations.handshake``) and both stop naming the differing fields if they disagree.
Non-finite values (``integrations.nonfinite``): with ``ppq.nonfinite="error"`` both sides of a boundary
stop naming stage, boundary and step; with ``"skip"`` every rank skips the step together and the codec
state returns to where the step found it.
Checkpoints carry each rank's codec state (``integrations.codec_state``).
"""

from __future__ import annotations

import time

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_ppq.compress import STAT_FIELDS, BoundaryChannel, NonFiniteStepError
from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config
from deepspeed_ppq.integrations.codec_state import CheckpointMixin
from deepspeed_ppq.integrations.ds_setup import _check_sample_ids, check_codecs, initialize
from deepspeed_ppq.integrations.ds_transport import TransportMixin, watched
from deepspeed_ppq.integrations.handshake import CodecMismatchError, HandshakeMixin, codec_settings
from deepspeed_ppq.integrations.nonfinite import NonFiniteMixin
from deepspeed_ppq.integrations.shm import release_at_exit

# DeepSpeed's CPU backend leaves a /dev/shm buffer per rank from init_distributed on: registered for removal
# at exit as soon as this module is imported, so a script that fails before initialize() leaves none.
release_at_exit()

__all__ = ["initialize", "PPQPipelineEngine", "CodecMismatchError", "NonFiniteStepError", "codec_settings",
           "check_codecs"]

_SHORT = {"activations": "act", "gradients": "grad"}  # ppq_stats' direction keys


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


class PPQPipelineEngine(CheckpointMixin, HandshakeMixin, NonFiniteMixin, TransportMixin, PipelineEngine):
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
        if self.ppq.aqsgd.enabled:
            _check_sample_ids(kwargs.get("training_data"), ppq_sample_ids)
        check_codecs(self.ppq)  # on every rank before any communication: no rank waits on a failed one
        super().__init__(*args, **kwargs)
        per_stage = ("recompute_stages", "recompute_layers")
        if any(self._config.pipeline.get(k) is not None for k in per_stage) and \
                self.module.activation_checkpoint_interval > 0:
            # pipeline.recompute_stages/_layers (per stage, per layer) replace activation_checkpoint_interval
            self.module.activation_checkpoint_interval = 0
        self._compressing = self.ppq.activations.enabled or self.ppq.gradients.enabled
        if self._compressing and (self.is_pipe_partitioned or self.has_bool_tensors):
            raise NotImplementedError(
                "ppq compression does not support pipe_partitioned/grad_partitioned (tensor parallel > 1) "
                "or has_bool_tensors; set ppq.activations.method and ppq.gradients.method to 'none'"
            )
        # one channel per boundary this stage talks over: it sends activations over its own boundary
        # (upstream side) and receives them over the previous one (downstream side)
        self._channels: dict[int, BoundaryChannel] = {}
        if not self.is_last_stage():
            b = self.stage_id
            self._channels[b] = BoundaryChannel(self.ppq, boundary=b, side="upstream")
        if not self.is_first_stage():
            b = self.stage_id - 1
            self._channels[b] = BoundaryChannel(self.ppq, boundary=b, side="downstream")
        self._sample_ids: dict[int, torch.Tensor] = {}  # buffer -> int64[B]
        self._pending_ids: torch.Tensor | None = None
        self._init_transport(ppq_overlap_sends)
        if self.is_pipe_parallel:
            self._wait_for(f"the start-up handshake with the neighbouring stages of stage {self.stage_id}")
            self._handshake()
            self._done_waiting(idle=True)

    @property
    def ppq_channels(self) -> dict[int, BoundaryChannel]:
        """This rank's ``BoundaryChannel`` per boundary index (codec state, counters, ``mode``)."""
        return dict(self._channels)

    def _step_args(self) -> dict:
        return {"training": self.module.training, "step": self.global_steps}

    # ---------------------------------------------------------------- data path
    def _next_batch(self):
        """DeepSpeed's batch; with AQ-SGD on (and only then) a training batch is ``(inputs, labels,
        sample_ids)`` and the third element is taken off as the sample ids. Without AQ-SGD the batch goes
        to DeepSpeed untouched, as with stock DeepSpeed (which ignores elements past the second)."""
        batch = super()._next_batch()
        if not self.ppq.aqsgd.enabled:
            return batch
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            self._pending_ids = torch.as_tensor(batch[2]).to(self.device, torch.int64).reshape(-1)
            batch = (batch[0], batch[1])
        elif self.module.training:
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

    # ------------------------------------------------------------- activations
    def _exec_send_activations(self, buffer_id):
        ch, step = self._channels[self.stage_id], self._step_args()
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if ch.mode("activations", **step) is None:
            super()._exec_send_activations(buffer_id)
            ch.passed_plain("activations", _as_tuple(outputs), sent=True, step=self.global_steps)
            ch.raise_if_flagged(self.global_steps, flush=self._wait_sends)
            return
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        ids = None
        if ch.needs_sample_ids(training=self.module.training):
            ids = self._sample_ids.get(buffer_id)
            if ids is None:
                raise PPQConfigError("ppq.aqsgd.enabled=true but this micro-batch came without sample_ids")
            p2p.send(ids, self.next_stage)
            ch.count_side("activations", ids.numel() * ids.element_size())
        for idx, t in enumerate(_as_tuple(outputs)):
            if not t.is_floating_point():
                p2p.send(t, self.next_stage)
                ch.count_side("activations", t.numel() * t.element_size())
                continue
            n = ch.nbytes("activations", t.shape, t.dtype, slot=idx, **step)
            payload = ch.send("activations", t, slot=idx, micro_batch=buffer_id, sample_ids=ids,
                              out=self._send_buffer("act", idx, n, buffer_id), **step)
            self._send_payload(payload, self.next_stage, "act", idx, buffer_id)
            ch.raise_if_flagged(self.global_steps, flush=self._wait_sends)

    def _exec_recv_activations(self, buffer_id):
        ch, step = self._channels[self.stage_id - 1], self._step_args()
        if ch.mode("activations", **step) is None:
            super()._exec_recv_activations(buffer_id)
            ch.passed_plain("activations", _as_tuple(self.pipe_buffers["inputs"][buffer_id]), sent=False,
                            step=self.global_steps)
            return
        if self.dynamic_shape or self.pipe_recv_buf is None:
            self.pipe_recv_buf = self._recv_tensor_meta(self.prev_stage)
        ids = None
        if ch.needs_sample_ids(training=self.module.training):
            ids = torch.empty(self.micro_batch_size, dtype=torch.int64, device=self.device)
            p2p.recv(ids, self.prev_stage)
            self._sample_ids[buffer_id] = ids  # forwarded with this micro-batch's activation
        recvd = []
        for idx, buf in enumerate(_as_tuple(self.pipe_recv_buf)):
            if not buf.is_floating_point():
                p2p.recv(buf, self.prev_stage)
                recvd.append(buf.clone().detach())
                continue
            shape = tuple(buf.shape)
            n = ch.nbytes("activations", shape, buf.dtype, slot=idx, **step)
            payload = self._recv_payload("act", idx, n, self.prev_stage)
            x = torch.empty(shape, dtype=buf.dtype, device=self.device)
            ch.recv("activations", payload, shape, buf.dtype, slot=idx, micro_batch=buffer_id, sample_ids=ids,
                    out=x, **step)
            x.requires_grad = True
            recvd.append(x)
        self.pipe_buffers["inputs"][buffer_id] = recvd[0] if isinstance(self.pipe_recv_buf, torch.Tensor) \
            else tuple(recvd)

    # --------------------------------------------------------------- gradients
    def _exec_send_grads(self, buffer_id):
        ch, step = self._channels[self.stage_id - 1], self._step_args()
        inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
        if ch.mode("gradients", **step) is None:
            grads = [t.grad for t in inputs if t.is_floating_point() and t.grad is not None]
            super()._exec_send_grads(buffer_id)
            ch.passed_plain("gradients", grads, sent=True, step=self.global_steps, micro_batch=buffer_id)
            ch.raise_if_flagged(self.global_steps, flush=self._wait_sends)
        else:
            for idx, t in enumerate(inputs):
                if not t.is_floating_point():
                    continue
                if t.grad is None:
                    raise RuntimeError(f"stage {self.stage_id}: input {idx} of micro-batch buffer "
                                       f"{buffer_id} has no gradient to send back")
                n = ch.nbytes("gradients", t.grad.shape, t.grad.dtype, slot=idx, **step)
                payload = ch.send("gradients", t.grad, slot=idx, micro_batch=buffer_id,
                                  out=self._send_buffer("grad", idx, n, buffer_id), **step)
                self._send_payload(payload, self.prev_stage, "grad", idx, buffer_id)
                ch.raise_if_flagged(self.global_steps, flush=self._wait_sends)
            self.pipe_buffers["inputs"][buffer_id] = None
        self._sample_ids.pop(buffer_id, None)

    def _exec_recv_grads(self, buffer_id):
        ch, step = self._channels[self.stage_id], self._step_args()
        if ch.mode("gradients", **step) is None:
            super()._exec_recv_grads(buffer_id)
            ch.passed_plain("gradients", _as_tuple(self.grad_layer), sent=False, step=self.global_steps,
                            micro_batch=buffer_id)
            return
        outputs = self.pipe_buffers["outputs"][buffer_id]
        grads = []
        for idx, t in enumerate(_as_tuple(outputs)):
            if not t.is_floating_point():
                continue
            shape = tuple(t.shape)
            n = ch.nbytes("gradients", shape, t.dtype, slot=idx, **step)
            payload = self._recv_payload("grad", idx, n, self.next_stage)
            # reused across micro-batches, as DeepSpeed reuses grad_layer (consumed before the next RecvGrad)
            g = self._buffer(("grad_out", idx, shape, t.dtype), shape, t.dtype)
            ch.recv("gradients", payload, shape, t.dtype, slot=idx, micro_batch=buffer_id, out=g, **step)
            grads.append(g)
        self.grad_layer = grads[0] if isinstance(outputs, torch.Tensor) else grads

    # ------------------------------------------------------------------- steps
    def train_batch(self, data_iter=None):
        t_step = time.perf_counter()
        self._done_waiting()
        for ch in self._channels.values():
            ch.clear_flags()
            ch.begin_step()  # a skipped or failed step rolls its codec state back
        try:
            loss = super().train_batch(data_iter)
        except BaseException:
            self._ppq_stop_timers()  # so the engine can still be used (say, to save a checkpoint)
            for ch in self._channels.values():
                ch.rollback()
            raise
        finally:
            for ch in self._channels.values():
                ch.commit()  # no-op after a skip (already rolled back)
            self._done_waiting(idle=True, step_seconds=time.perf_counter() - t_step)
        for ch in self._channels.values():
            ch.clear_flags()
        spp = self.steps_per_print() or 1
        if self.monitor.enabled and self.global_steps % spp == 0:
            stats = self.ppq_stats(all_stages=True)
            if self.global_rank == 0:
                self.monitor.write_events([(f"PPQ/boundary{b}/{d}/{k}", v, self.global_samples)
                                           for (b, d), fields in sorted(stats.items())
                                           for k, v in fields.items()])
        return loss

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's ``eval_batch``; a non-finite value seen here (``ppq.nonfinite="skip"``) concerns this
        evaluation only and never skips the next training step."""
        for ch in self._channels.values():
            ch.clear_flags()
        self._done_waiting()
        try:
            return super().eval_batch(*args, **kwargs)
        except BaseException:
            self._ppq_stop_timers()
            raise
        finally:
            for ch in self._channels.values():
                ch.clear_flags()
            self._done_waiting(idle=True)

    def _ppq_stop_timers(self) -> None:
        for timer in getattr(self.timers, "timers", {}).values():
            if getattr(timer, "started_", False):
                timer.stop()

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
        keys = [(b, d) for b in range(self.num_stages - 1) for d in _SHORT]
        rows = [[float(self._channels[b].stats[d][f]) if b in self._channels else 0.0 for f in STAT_FIELDS]
                for b, d in keys]
        if all_stages and rows:
            vec = torch.tensor(rows, dtype=torch.float64, device=self.device)
            dist.all_reduce(vec, group=self.grid.get_pipe_parallel_group())
            rows = vec.cpu().tolist()
        return {(b, _SHORT[d]): dict(zip(STAT_FIELDS, row)) for (b, d), row in zip(keys, rows)}

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.OptimizerStep: watched(NonFiniteMixin._exec_optimizer_step,
                                        "the optimizer step's all-reduce over every stage"),
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.SendActivation: watched(_exec_send_activations, "stage {next} to receive activations "
                                                                 "(SendActivation, buffer {buffer_id})"),
        schedule.RecvActivation: watched(_exec_recv_activations, "activations from stage {prev} "
                                                                 "(RecvActivation, buffer {buffer_id})"),
        schedule.SendGrad: watched(_exec_send_grads, "stage {prev} to receive gradients (SendGrad, buffer "
                                                     "{buffer_id})"),
        schedule.RecvGrad: watched(_exec_recv_grads, "gradients from stage {next} (RecvGrad, buffer "
                                                     "{buffer_id})"),
    }
