"""One pipeline boundary's traffic: both directions' codecs, when they compress, and what crossed.

A :class:`BoundaryChannel` is what the engines (DeepSpeed's ``PPQPipelineEngine``, megatron-core's
``PPQP2PCommunicator``) and the single-process reference (``compressed_boundary``) talk through; they
only move its payloads. Per direction (``"activations"`` forward, ``"gradients"`` backward) and tuple slot
it owns the encoder/decoder of its side of the boundary, and:

* the rule "is this direction compressed now" (:func:`codec_mode`): evaluation (``eval_compressed``),
  ``ppq.warmup_steps``, AQ-SGD's warm-up;
* TopK index reuse keyed by micro-batch: the indices the activation of micro-batch ``m`` was sent with
  (upstream) or decoded with (downstream) serve the gradient of ``m``, which then travels as values only;
  a gradient whose activation was flagged travels as a flagged payload of the agreed size;
* AQ-SGD per-sample buffers (the sample ids come in with each training activation; ``sample_dim`` says
  which dimension of the activation is the sample);
* non-finite values: every message is checked (a compressed one carries its sender's flag), each place is
  listed in ``flagged``; with ``ppq.nonfinite="error"`` the receiver raises :class:`NonFiniteStepError` at
  once and the sender once its message is out (:meth:`BoundaryChannel.raise_if_flagged`), so no stage
  waits on a stopped one;
* the counters per direction: raw and wire bytes, side bytes (sample ids, integer tensors), messages,
  encode and decode seconds. A sender counts bytes and encode time, a receiver decode time.

Sides: the stage upstream of the boundary sends activations and receives gradients (``"upstream"``), the
stage downstream receives activations and sends gradients (``"downstream"``); ``"both"`` holds all four
in one process. A new codec lives in ``codecs.py``/``boundary.py``; the channel and the engines stay as
they are.
"""

from __future__ import annotations

import math
import time
from typing import Literal, NamedTuple

import torch

from deepspeed_ppq.compress.boundary import BoundaryDecoder, BoundaryEncoder
from deepspeed_ppq.config import CodecConfig, PPQConfig

__all__ = ["BoundaryChannel", "Mode", "codec_mode", "codec_settings", "NonFiniteStepError", "DIRECTIONS",
           "STAT_FIELDS"]

Direction = Literal["activations", "gradients"]
DIRECTIONS: tuple[str, str] = ("activations", "gradients")
STAT_FIELDS = ("raw_bytes", "wire_bytes", "side_bytes", "messages", "encode_s", "decode_s")
_ROLES = {"upstream": (("send", "activations"), ("recv", "gradients")),
          "downstream": (("recv", "activations"), ("send", "gradients"))}
_ROLES["both"] = _ROLES["upstream"] + _ROLES["downstream"]
_MISSING = object()


class NonFiniteStepError(RuntimeError):
    """A tensor crossing a stage boundary held NaN/Inf and ``ppq.nonfinite`` is ``"error"``."""


def _stop(what: str, where: str, step) -> NonFiniteStepError:
    return NonFiniteStepError(f"NaN/Inf {what} {where} (step {step}); ppq.nonfinite='error' stops training. "
                              "Set ppq.nonfinite='skip' to skip such steps instead.")


class Mode(NamedTuple):
    """How a message goes through the codec: ``training`` (stateful) or evaluation (stateless), and
    ``uncompressed`` (a raw payload: AQ-SGD's warm-up fills its per-sample buffers with exact values)."""

    training: bool
    uncompressed: bool


def codec_mode(cfg: PPQConfig, direction: str, *, training: bool = True, step: int | None = None
               ) -> Mode | None:
    """How ``direction`` crosses a boundary at this ``step``: ``None`` when the tensor itself goes on the
    wire (codec ``none``, ``ppq.warmup_steps``, evaluation without ``eval_compressed``), else the codec's
    :class:`Mode`. Both sides of a boundary compute the same answer from the same settings and step.

    Args:
        cfg: the ``"ppq"`` section.
        direction: ``"activations"`` or ``"gradients"``.
        training: a training step (evaluation is compressed only when ``eval_compressed``, statelessly).
        step: the optimizer step (0-based); ``None`` is past every warm-up.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: use 'activations' or 'gradients'")
    codec: CodecConfig = getattr(cfg, direction)
    if not codec.enabled:
        return None
    if not training:
        return Mode(False, False) if codec.eval_compressed else None

    def warm(n: int) -> bool:
        return step is not None and step < n

    # AQ-SGD fills its per-sample buffers while warming up, so its activations go through the codec raw
    # (during ppq.warmup_steps as well); its gradients stay compressed (config.py) -- except TopK
    # gradients reusing the activation's indices: a raw activation has none, so they go raw too.
    aq_warm = cfg.aqsgd.enabled and warm(max(cfg.warmup_steps, cfg.aqsgd.warmup_steps))
    if direction == "activations" and cfg.aqsgd.enabled:
        return Mode(True, aq_warm)
    if warm(cfg.warmup_steps):
        return None
    return Mode(True, aq_warm and _values_only(cfg))


def _values_only(cfg: PPQConfig) -> bool:
    g = cfg.gradients
    return g.method == "topk" and g.reuse_indices


def codec_settings(cfg: PPQConfig) -> dict:
    """What both sides of a boundary must agree on: every input of the codecs and of :func:`codec_mode`."""
    return {
        "activations": cfg.activations.model_dump(mode="json"),
        "gradients": cfg.gradients.model_dump(mode="json"),
        "aqsgd": cfg.aqsgd.model_dump(mode="json", include={"enabled", "warmup_steps"}),
        "warmup_steps": cfg.warmup_steps,
        "nonfinite": cfg.nonfinite,
    }


class BoundaryChannel:
    """One side (or both sides) of one pipeline boundary: its codecs, their state and its counters.

    Args:
        cfg: the ``"ppq"`` section (codecs, AQ-SGD, warm-up, non-finite policy).
        boundary: the boundary's index (stage ``boundary`` -> ``boundary + 1``).
        side: ``"upstream"``, ``"downstream"`` or ``"both"`` (see the module docstring).
        label: names the boundary in messages; default ``"boundary b (stage b -> b+1)"``.
        stage: the stage this side runs on, for messages (default from ``boundary`` and ``side``).
        sample_dim: the activation dimension that indexes samples (AQ-SGD's buffers; 1 for megatron-core's
            ``[seq, batch, hidden]``).

    Raises:
        ValueError: codec settings the codecs reject (checked now, for tuple slot 0).

    Attributes:
        stats: ``{direction: {field: value}}`` for the fields of ``STAT_FIELDS``.
        flagged: where non-finite values were seen since :meth:`clear_flags`.
    """

    def __init__(self, cfg: PPQConfig, *, boundary: int = 0, side: str = "both", label: str | None = None,
                 stage: int | None = None, sample_dim: int = 0):
        if side not in _ROLES:
            raise ValueError(f"side={side!r}: use 'upstream', 'downstream' or 'both'")
        self.cfg, self.boundary, self.side, self.sample_dim = cfg, boundary, side, sample_dim
        self.label = label or f"boundary {boundary} (stage {boundary} -> {boundary + 1})"
        own = {"upstream": boundary, "downstream": boundary + 1}.get(side)
        self.stage = stage if stage is not None else own
        self.compressing = cfg.activations.enabled or cfg.gradients.enabled
        self.stats = {d: {f: 0.0 if f.endswith("_s") else 0 for f in STAT_FIELDS} for d in DIRECTIONS}
        self.flagged: list[str] = []
        self._sides: dict[tuple[str, str, int], BoundaryEncoder | BoundaryDecoder] = {}
        # TopK indices of activations, by (micro-batch, slot): "send" as sent, "recv" as decoded
        self._kept: dict[str, dict] = {"send": {}, "recv": {}}
        self._step_open = False
        for role, direction in _ROLES[side]:
            try:
                self._side(role, direction, 0)
            except ValueError as err:
                settings = getattr(cfg, direction).model_dump(mode="json")
                raise ValueError(f"ppq.{direction}={settings} is not usable: {err}") from None

    # ------------------------------------------------------------------ the rule
    def mode(self, direction: Direction, *, training: bool = True, step: int | None = None) -> Mode | None:
        """:func:`codec_mode` for this channel's settings."""
        return codec_mode(self.cfg, direction, training=training, step=step)

    def needs_sample_ids(self, *, training: bool = True) -> bool:
        """Whether activations must come with their sample ids (AQ-SGD, training)."""
        return self.cfg.aqsgd.enabled and training

    def name(self, direction: str, slot: int = 0) -> str:
        return f"{self.label} {direction}[{slot}]"

    def nbytes(self, direction: Direction, shape, dtype: torch.dtype, *, slot: int = 0, training: bool = True,
               step: int | None = None) -> int:
        """Bytes of the next message of ``shape``/``dtype``: the payload a receiver allocates, or the
        tensor's own bytes when :meth:`mode` is None."""
        mode = self.mode(direction, training=training, step=step)
        if mode is None:
            return math.prod(shape) * dtype.itemsize
        role = "recv" if ("recv", direction) in _ROLES[self.side] else "send"
        return self._side(role, direction, slot).nbytes(tuple(shape), dtype, **mode._asdict())

    # ------------------------------------------------------------ the messages
    def send(self, direction: Direction, x: torch.Tensor, *, slot: int = 0, micro_batch=0, sample_ids=None,
             training: bool = True, step: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """What goes on the wire for ``x``: its uint8 payload (into ``out`` when given), or ``x`` itself when
        :meth:`mode` is None.

        Args:
            direction: ``"activations"`` (upstream side) or ``"gradients"`` (downstream side).
            slot: the tensor's index in a tuple activation.
            micro_batch: keys TopK index reuse: the gradient of a micro-batch reuses its activation's indices.
            sample_ids: the samples' dataset indices (AQ-SGD activations in training).
            out: a uint8 buffer of :meth:`nbytes` bytes on ``x``'s device to encode into.
        """
        t0 = time.perf_counter()
        mode = self._coded(direction, x, sent=True, training=training, step=step, micro_batch=micro_batch)
        if mode is None:
            return x
        enc = self._side("send", direction, slot)
        x = x.detach()
        if direction == "activations":
            payload = enc.encode(x, sample_ids=sample_ids, out=out, **mode._asdict())
            if training and _values_only(self.cfg):
                self._kept["send"][(micro_batch, slot)] = enc.last_indices
        else:
            kept = self._kept["recv"].pop((micro_batch, slot), _MISSING)
            if enc.values_only and not mode.uncompressed:
                if self._need(kept, direction, slot, micro_batch) is None:  # its activation was flagged
                    payload = enc.encode_flagged(x.shape, x.dtype, out=out, **mode._asdict())
                else:
                    payload = enc.encode(x.contiguous(), indices=kept, out=out, **mode._asdict())
            else:
                payload = enc.encode(x.contiguous(), out=out, **mode._asdict())
        st = self.stats[direction]
        st["raw_bytes"] += x.numel() * x.element_size()
        st["wire_bytes"] += payload.numel()
        st["messages"] += 1
        st["encode_s"] += time.perf_counter() - t0
        self._note(enc.last_nonfinite, direction, slot, sent=True, step=step)
        return payload

    def recv(self, direction: Direction, wire: torch.Tensor, shape, dtype: torch.dtype, *, slot: int = 0,
             micro_batch=0, sample_ids=None, training: bool = True, step: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor of ``shape``/``dtype`` that ``wire`` (what :meth:`send` gave the other side) carries,
        decoded into ``out`` when given; NaN-filled when the sender flagged non-finite values.

        Raises:
            NonFiniteStepError: a flagged or non-finite message with ``ppq.nonfinite="error"``.
        """
        t0 = time.perf_counter()
        mode = self._coded(direction, wire, sent=False, training=training, step=step, micro_batch=micro_batch)
        if mode is None:
            return wire
        dec = self._side("recv", direction, slot)
        if direction == "activations":
            y = dec.decode(wire, tuple(shape), dtype, sample_ids=sample_ids, out=out, **mode._asdict())
            if training and _values_only(self.cfg):
                self._kept["recv"][(micro_batch, slot)] = dec.last_indices
        else:
            kept = self._kept["send"].pop((micro_batch, slot), _MISSING)
            reuse = dec.values_only and not mode.uncompressed
            indices = self._need(kept, direction, slot, micro_batch) if reuse else None
            y = dec.decode(wire, tuple(shape), dtype, indices=indices, out=out, **mode._asdict())
        self.stats[direction]["decode_s"] += time.perf_counter() - t0
        self._note(dec.last_nonfinite, direction, slot, sent=False, step=step)
        return y

    def _coded(self, direction: str, tensor, *, sent: bool, training: bool, step, micro_batch) -> Mode | None:
        """:meth:`mode`; when None, ``tensor`` crossed as itself: :meth:`passed_plain`."""
        mode = self.mode(direction, training=training, step=step)
        if mode is None:
            self.passed_plain(direction, (tensor,), sent=sent, step=step, micro_batch=micro_batch)
        return mode

    def _need(self, kept, direction: str, slot: int, micro_batch):
        if kept is _MISSING:
            raise RuntimeError(f"{self.name(direction, slot)}: no TopK indices are kept for micro-batch "
                               f"{micro_batch!r}: its gradient crossed before its activation (out of order?)")
        return kept

    def passed_plain(self, direction: Direction, tensors, *, sent: bool, step: int | None = None,
                     micro_batch=None) -> None:
        """Account for tensors that crossed as themselves (the engine's own path, :meth:`mode` None):
        count what was sent (integer tensors as side bytes), check for NaN/Inf when a codec is
        configured, and forget the TopK indices a gradient of ``micro_batch`` will not need."""
        if direction == "gradients" and micro_batch is not None:
            self.forget(micro_batch)
        floats = [t for t in tensors if t is not None and t.is_floating_point()]
        if sent:
            st = self.stats[direction]
            for t in tensors:
                if t is None:
                    continue
                n = t.numel() * t.element_size()
                if t.is_floating_point():
                    st["raw_bytes"] += n
                    st["wire_bytes"] += n
                    st["messages"] += 1
                else:
                    st["side_bytes"] += n
        if self.compressing:  # codec "none" everywhere stays the framework's own path, unchecked
            for slot, t in enumerate(floats):
                if not bool(torch.isfinite(t).all()):
                    self._note(True, direction, slot, sent=sent, step=step)
                    return

    def count_side(self, direction: Direction, nbytes: int) -> None:
        """Count bytes sent beside the payloads (sample ids, integer tensors)."""
        self.stats[direction]["side_bytes"] += int(nbytes)

    # --------------------------------------------------------- non-finite values
    def _note(self, bad: bool, direction: str, slot: int, *, sent: bool, step) -> None:
        if not bad:
            return
        where = self.name(direction, slot) if self.stage is None else \
            f"stage {self.stage}, {self.name(direction, slot)}"
        self.flagged.append(where)
        if self.cfg.nonfinite == "error" and not sent:
            raise _stop("received at", where, step)

    def raise_if_flagged(self, step: int | None = None, flush=None) -> None:
        """With ``ppq.nonfinite="error"``: raise for a flagged message this side sent, after ``flush()``
        (say, waiting for sends in flight) so that the receiver gets the flag and stops too.

        Raises:
            NonFiniteStepError: naming the stage, the boundary, the direction and ``step``.
        """
        if self.cfg.nonfinite != "error" or not self.flagged:
            return
        if flush is not None:
            flush()
        raise _stop("to send at", self.flagged[-1], step)

    def clear_flags(self) -> None:
        self.flagged.clear()

    # ------------------------------------------------------------ codec state
    def _side(self, role: str, direction: str, slot: int):
        key = (role, direction, slot)
        side = self._sides.get(key)
        if side is not None:
            return side
        if (role, direction) not in _ROLES[self.side]:
            raise ValueError(f"{self.label}: the {self.side} side does not {role} {direction}")
        aq = self.cfg.aqsgd if direction == "activations" and self.cfg.aqsgd.enabled else None
        codec = getattr(self.cfg, direction)
        if role == "send":  # flag non-finite values in the payload: the receiver learns of them too
            side = BoundaryEncoder(codec, name=self.name(direction, slot), aqsgd=aq, nonfinite="skip",
                                   direction=direction, sample_dim=self.sample_dim)
        else:
            side = BoundaryDecoder(codec, name=self.name(direction, slot), aqsgd=aq, direction=direction,
                                   sample_dim=self.sample_dim)
        if self._step_open:
            side.begin_step()
        self._sides[key] = side
        return side

    def begin_step(self) -> None:
        """Open an optimizer step whose codec state updates (EF/EF21/AQ-SGD) :meth:`rollback` can undo."""
        if not self.compressing:
            return
        self._step_open = True
        for side in self._sides.values():
            side.begin_step()

    def commit(self) -> None:
        self._step_open = False
        for side in self._sides.values():
            side.commit()

    def rollback(self) -> None:
        """The codec state as :meth:`begin_step` found it: a skipped step's batch was never seen."""
        self._step_open = False
        for side in self._sides.values():
            side.rollback()

    def forget(self, micro_batch) -> None:
        """Drop the TopK indices kept for ``micro_batch`` (its gradient will not come through the codec)."""
        for kept in self._kept.values():
            for key in [k for k in kept if k[0] == micro_batch]:
                del kept[key]

    def clear_micro_batches(self) -> None:
        """Forget the TopK indices kept for gradients still to come (a schedule ended or failed)."""
        for kept in self._kept.values():
            kept.clear()

    def state_dict(self) -> dict:
        """The codec state and counters: ``{"sides": {"send|activations|0": {...}}, "stats": {...}}``
        (tensors, ints, floats and strings only)."""
        sides = {f"{r}|{d}|{s}": st for (r, d, s), side in sorted(self._sides.items())
                 if (st := side.state_dict())}
        return {"sides": sides, "stats": {d: dict(v) for d, v in self.stats.items()}}

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        """Restore what :meth:`state_dict` gave (a side this channel does not hold is an error)."""
        for key, st in state.get("sides", {}).items():
            role, direction, slot = key.split("|")
            self._side(role, direction, int(slot)).load_state_dict(st, device)
        for direction, fields in state.get("stats", {}).items():
            for f in STAT_FIELDS:
                if f in fields:
                    v = fields[f]
                    self.stats[direction][f] = float(v) if f.endswith("_s") else int(v)
