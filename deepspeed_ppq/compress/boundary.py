"""Both sides of one compressed (boundary, direction), with their state.

``BoundaryEncoder`` lives on the sending stage, ``BoundaryDecoder`` on the receiving stage; each owns
its half of the state (EF buffer; EF21 ``g``; AQ-SGD per-sample buffers). A ``BoundaryChannel``
(``channel.py``) holds the ones of a boundary, decides their ``training``/``uncompressed`` arguments and
keeps the counters; use these two directly only for a single codec outside a pipeline (say, to time it).

When a message is compressed:
  * training: always (unless ``uncompressed=True``: the engine's warm-up steps);
  * evaluation (``training=False``): when ``cfg.eval_compressed``, statelessly (no EF/EF21/AQ-SGD);
    otherwise raw.
``nbytes(shape, dtype, training=..., uncompressed=...)`` gives the payload size for either case.

TopK index reuse: an activation encoder keeps the indices it chose in ``last_indices``; its decoder
exposes the indices it decoded in ``last_indices``. A gradient encoder/decoder built with
``direction="gradients"`` and ``cfg.reuse_indices`` sends values only: pass the receiving stage's
decoded indices to ``encode(indices=...)`` and the sending stage's kept indices to
``decode(indices=...)``. The channel keys these by micro-batch.

AQ-SGD's per-sample buffers index the activation's ``sample_dim`` (0 unless the framework puts the
sample elsewhere, e.g. megatron-core's ``[seq, batch, hidden]``).
"""

from __future__ import annotations

from typing import Literal

import torch

from deepspeed_ppq.compress.aqsgd import SampleBuffers
from deepspeed_ppq.compress.codecs import (
    PayloadLayout,
    decode_from,
    encode_into,
    payload_layout,
    payload_status,
    write_flagged,
)
from deepspeed_ppq.compress.feedback import FeedbackState, mixed_topk_indices
from deepspeed_ppq.config import AQSGDConfig, CodecConfig

__all__ = ["NonFiniteError", "BoundaryEncoder", "BoundaryDecoder"]

_NONE = CodecConfig()


class NonFiniteError(FloatingPointError):
    """A tensor to compress held NaN or Inf and ``ppq.nonfinite`` is ``"error"``."""


class _Side:
    """What encoder and decoder share: config checks, mode selection, AQ-SGD rows, state."""

    role = ""

    def __init__(self, cfg: CodecConfig, *, name: str, aqsgd: AQSGDConfig | None = None,
                 direction: Literal["activations", "gradients"] = "activations", sample_dim: int = 0):
        if direction not in ("activations", "gradients"):
            raise ValueError(f"direction={direction!r}: use 'activations' or 'gradients'")
        ef = cfg.error_feedback
        if ef != "none" and cfg.method == "none":
            raise ValueError(f"{name}: error_feedback={ef!r} needs a compressing method (got method='none')")
        if ef == "ef_mixed" and cfg.method != "topk":
            raise ValueError(f"{name}: error_feedback='ef_mixed' needs method='topk' (got {cfg.method!r})")
        self.aqsgd = aqsgd if aqsgd is not None and aqsgd.enabled else None
        if self.aqsgd is not None:
            if direction != "activations":
                raise ValueError(f"{name}: AQ-SGD applies to activations only (direction={direction!r})")
            if cfg.method == "none":
                raise ValueError(f"{name}: aqsgd.enabled=true needs a compressing activations.method")
            if ef != "none":
                raise ValueError(f"{name}: aqsgd.enabled=true replaces error feedback (got {ef!r})")
        self.cfg = cfg
        self.name = name
        self.direction = direction
        self.values_only = direction == "gradients" and cfg.method == "topk" and cfg.reuse_indices
        self.state = FeedbackState()
        self.buffers = SampleBuffers(self.aqsgd, name, self.role) if self.aqsgd is not None else None
        if sample_dim < 0:
            raise ValueError(f"{name}: sample_dim={sample_dim} must be >= 0")
        self.sample_dim = sample_dim
        self.last_indices: torch.Tensor | None = None
        self.last_nonfinite = False

    def _mode(self, training: bool, uncompressed: bool) -> str:
        """``raw``, ``plain`` (stateless codec) or ``stateful``."""
        if not self.cfg.enabled or uncompressed:
            return "raw"
        if not training:
            return "plain" if self.cfg.eval_compressed else "raw"
        return "stateful"

    def _layout(self, shape, dtype, mode: str) -> PayloadLayout:
        cfg = _NONE if mode == "raw" else self.cfg
        return payload_layout(cfg, shape, dtype, values_only=self.values_only and mode != "raw")

    def nbytes(self, shape, dtype, *, training: bool = True, uncompressed: bool = False) -> int:
        """Payload size of the next message of ``shape``/``dtype`` (what a receiver allocates)."""
        return self._layout(shape, dtype, self._mode(training, uncompressed)).nbytes

    def _decoded_f32(self, payload, lay, indices) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(lay.shape, dtype=torch.float32, device=payload.device)
        return out, decode_from(self.cfg, payload, lay, out, indices=indices)

    def _check_ids(self, sample_ids, shape) -> int:
        d = self.sample_dim
        if d >= len(shape):
            raise ValueError(f"{self.name}: sample_dim={d} but the message has shape {tuple(shape)}")
        n = None if sample_ids is None else torch.as_tensor(sample_ids).numel()
        if n is not None and n != shape[d]:
            raise ValueError(f"{self.name}: {n} sample_ids for a message of {shape[d]} samples (shape "
                             f"{tuple(shape)}, sample_dim={d}): give one dataset index per sample")
        return d

    def _rows(self, sample_ids, shape, device) -> torch.Tensor:
        """AQ-SGD: the per-sample buffers of ``sample_ids`` laid out as a message of ``shape``."""
        d = self._check_ids(sample_ids, shape)
        sample_shape = tuple(shape[:d]) + tuple(shape[d + 1:])
        return self.buffers.gather(sample_ids, sample_shape, device=device).movedim(0, d)

    def _store_rows(self, sample_ids, values: torch.Tensor) -> None:
        d = self._check_ids(sample_ids, values.shape)
        self.buffers.scatter(sample_ids, values.movedim(d, 0))

    def state_dict(self) -> dict:
        """This side's codec state as plain tensors: the EF/EF21 buffer, the AQ-SGD per-sample buffers."""
        out: dict = {}
        if self.state.buf is not None:
            out["feedback"] = self.state.buf.detach().cpu().clone()
        if self.buffers is not None:
            out.update(self.buffers.state_dict())
        return out

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        self.state.buf = state["feedback"].to(device) if "feedback" in state else None
        if self.buffers is not None:
            self.buffers.load_state_dict(state, device)

    def begin_step(self) -> None:
        """Start an optimizer step whose state updates ``rollback`` can undo (``ppq.nonfinite="skip"``)."""
        self.state.begin_step()
        if self.buffers is not None:
            self.buffers.begin_step()

    def commit(self) -> None:
        self.state.commit()
        if self.buffers is not None:
            self.buffers.commit()

    def rollback(self) -> None:
        """Return EF/EF21 state and AQ-SGD buffers to where ``begin_step`` found them: a skipped step leaves
        the codec state as if its batch had never been seen."""
        self.state.rollback()
        if self.buffers is not None:
            self.buffers.rollback()


class BoundaryEncoder(_Side):
    """Sender side of one (boundary, direction).

    Args:
        cfg: the direction's codec.
        name: names the boundary and direction in errors and counters, e.g. ``"stage0->1 activations"``.
        aqsgd: AQ-SGD config (activations only); ignored unless enabled.
        nonfinite: ``"error"`` raises ``NonFiniteError`` on NaN/Inf; ``"skip"`` flags the payload.
        direction: ``"activations"`` or ``"gradients"`` (gradients may reuse the activation's TopK indices).
        sample_dim: the dimension of a message that indexes its samples (AQ-SGD's buffers).

    Attributes:
        last_indices: TopK indices ``[B, K]`` of the last message (None for other codecs).
        last_nonfinite: whether the last message was flagged.
    """

    role = "send"

    def __init__(
        self,
        cfg: CodecConfig,
        *,
        name: str,
        aqsgd: AQSGDConfig | None = None,
        nonfinite: Literal["error", "skip"] = "error",
        direction: Literal["activations", "gradients"] = "activations",
        sample_dim: int = 0,
    ):
        super().__init__(cfg, name=name, aqsgd=aqsgd, direction=direction, sample_dim=sample_dim)
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"nonfinite={nonfinite!r}: use 'error' or 'skip'")
        self.nonfinite = nonfinite

    @torch.no_grad()
    def encode(
        self,
        x: torch.Tensor,
        *,
        training: bool = True,
        sample_ids=None,
        indices: torch.Tensor | None = None,
        uncompressed: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compress ``x`` into a uint8 payload of ``self.nbytes(x.shape, x.dtype, ...)`` bytes.

        Args:
            x: the activation or gradient.
            training: evaluation messages are stateless (and raw unless ``cfg.eval_compressed``).
            sample_ids: dataset index of each sample of ``x`` (AQ-SGD).
            indices: values-only TopK gradients: the indices the receiving stage decoded for this
                micro-batch's activation.
            uncompressed: send raw (warm-up steps); AQ-SGD buffers are filled with ``x``.
            out: a uint8 buffer of exactly that size on ``x``'s device to write into (an engine reuses
                one per boundary once the previous send completed); default a fresh tensor.

        Raises:
            NonFiniteError: NaN/Inf in ``x`` with ``nonfinite="error"``.
        """
        mode = self._mode(training, uncompressed)
        lay = self._layout(x.shape, x.dtype, mode)
        if indices is not None and not lay.values_only:
            raise ValueError(
                f"{self.name}: indices= given, but this encoder picks its own (it needs method='topk', "
                "reuse_indices=true and direction='gradients')"
            )
        if lay.values_only and indices is None:
            raise ValueError(f"{self.name}: TopK gradients reuse the activation's indices: pass indices=")
        if out is None:
            payload = torch.empty(lay.nbytes, dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or out.numel() != lay.nbytes or out.device != x.device \
                or not out.is_contiguous():
            raise ValueError(f"{self.name}: out must be a contiguous uint8 tensor of {lay.nbytes} bytes on "
                             f"{x.device}, got {out.dtype} with {out.numel()} elements on {out.device}")
        else:
            payload = out.view(-1)
        x = x.detach()
        if mode == "raw":
            encode_into(_NONE, x, payload, lay)
            self.last_indices = None
            if self._finish(payload, lay) and self.buffers is not None and training:
                self._store_rows(sample_ids, x.float())  # never a non-finite value
            return payload
        if mode == "plain":
            full = encode_into(self.cfg, x, payload, lay, indices=indices)
            self.last_indices = full if self._finish(payload, lay) else None
            return payload

        ef = self.cfg.error_feedback
        base = None
        if self.buffers is not None:
            base = self._rows(sample_ids, x.shape, x.device)
            msg = x.float() - base
        elif ef in ("ef", "ef_mixed"):
            msg = x.float() + self.state.get(x.shape, x.device)
        elif ef == "ef21":
            msg = x.float() - self.state.get(x.shape, x.device)
        else:
            msg = x
        if ef == "ef_mixed" and indices is None:
            B = x.shape[0]
            e = self.state.get(x.shape, x.device)
            indices = mixed_topk_indices(x.reshape(B, -1), e.view(B, -1), lay.k)
        full = encode_into(self.cfg, msg.to(x.dtype), payload, lay, indices=indices)
        clean = self._finish(payload, lay)
        self.last_indices = full if clean else None  # a flagged message has no usable indices
        if clean and (ef != "none" or base is not None):
            dec, _ = self._decoded_f32(payload, lay, full)
            if base is not None:
                self._store_rows(sample_ids, base + dec)
            elif ef == "ef21":
                self.state.buf += dec
            else:
                self.state.buf = msg - dec
        return payload

    def encode_flagged(self, shape, dtype, *, training: bool = True, uncompressed: bool = False,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """A flagged payload of the agreed size for a message that cannot be encoded: a values-only TopK
        gradient of a micro-batch whose activation was flagged (so no indices exist). The receiver decodes
        NaN and the step is skipped (or stopped) as for any flagged message; no state changes."""
        lay = self._layout(shape, dtype, self._mode(training, uncompressed))
        payload = torch.empty(lay.nbytes, dtype=torch.uint8) if out is None else out.view(-1)
        write_flagged(payload, lay)
        self.last_indices = None
        self._finish(payload, lay)
        return payload

    def _finish(self, payload, lay) -> bool:
        """Apply the non-finite policy; returns whether the payload is clean."""
        bad = payload_status(payload) != 0
        self.last_nonfinite = bad
        if bad and self.nonfinite == "error":
            raise NonFiniteError(
                f"{self.name}: NaN or Inf in the tensor to compress (shape {lay.shape}, "
                "ppq.nonfinite='error'); set ppq.nonfinite='skip' to skip such steps instead"
            )
        return not bad


class BoundaryDecoder(_Side):
    """Receiver side of one (boundary, direction); mirrors the encoder's EF21 / AQ-SGD state.

    Args: as ``BoundaryEncoder`` (no ``nonfinite``: a flagged payload always decodes to NaN).

    Attributes:
        last_indices: TopK indices ``[B, K]`` of the last message (decoded, or the ones given).
        last_nonfinite: whether the last payload was flagged by its sender.
    """

    role = "recv"

    @torch.no_grad()
    def decode(
        self,
        payload: torch.Tensor,
        shape,
        dtype: torch.dtype,
        *,
        training: bool = True,
        sample_ids=None,
        indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        uncompressed: bool = False,
    ) -> torch.Tensor:
        """Reconstruct the tensor of ``shape``/``dtype`` from ``payload`` (into ``out`` when given).

        Args:
            indices: values-only TopK gradients: the indices this stage's activation encoder kept for
                the micro-batch.
            Others as ``BoundaryEncoder.encode``.

        Returns:
            ``out`` (or a new tensor); NaN-filled when the sender flagged non-finite values.
        """
        mode = self._mode(training, uncompressed)
        lay = self._layout(shape, dtype, mode)
        if out is None:
            out = torch.empty(lay.shape, dtype=dtype, device=payload.device)
        elif (tuple(out.shape) != lay.shape or out.dtype != dtype or not out.is_contiguous()
              or out.device != payload.device):
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {lay.shape} on the payload's "
                             f"device {payload.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        if payload.dtype != torch.uint8 or payload.numel() != lay.nbytes:
            raise ValueError(
                f"{self.name}: payload has {payload.numel()} {payload.dtype} elements, expected {lay.nbytes} "
                f"uint8 for shape {lay.shape} {dtype} (mode {mode}); do both stages use the same codec?"
            )
        payload = payload.reshape(-1)
        if payload_status(payload) != 0:  # before the indices check: a flagged message needs none
            self.last_nonfinite = True
            out.fill_(float("nan"))
            self.last_indices = None
            return out
        self.last_nonfinite = False
        if lay.values_only and indices is None and mode != "raw":
            raise ValueError(f"{self.name}: TopK gradients carry values only: pass the activation's indices=")
        if mode == "raw":
            decode_from(_NONE, payload, lay, out)
            if self.buffers is not None and training:
                self._store_rows(sample_ids, out.float())
            self.last_indices = None
        elif mode == "plain" or (self.buffers is None and self.cfg.error_feedback != "ef21"):
            self.last_indices = decode_from(self.cfg, payload, lay, out, indices=indices)
        else:
            dec, self.last_indices = self._decoded_f32(payload, lay, indices)
            if self.buffers is not None:
                full = self._rows(sample_ids, lay.shape, dec.device) + dec
                self._store_rows(sample_ids, full)
            else:
                g = self.state.get(lay.shape, payload.device)
                g += dec
                full = g
            out.copy_(full)
        return out
