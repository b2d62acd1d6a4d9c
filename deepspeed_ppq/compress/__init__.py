"""Activation/gradient codecs for pipeline stage boundaries, with their error-feedback state.

The API the engines (DeepSpeed ``PipelineEngine``, megatron-core P2P) code against is one
``BoundaryChannel`` per boundary (``channel.py``)::

    BoundaryChannel(cfg, *, boundary=0, side="both" | "upstream" | "downstream", label=None, stage=None,
                    sample_dim=0)
        .mode(direction, *, training, step) -> Mode(training, uncompressed) | None   # None: tensor as is
        .nbytes(direction, shape, dtype, *, slot, training, step) -> int             # what to receive
        .send(direction, x, *, slot, micro_batch, sample_ids, training, step, out) -> wire tensor
        .recv(direction, wire, shape, dtype, *, slot, micro_batch, sample_ids, training, step, out) -> tensor
        .passed_plain(direction, tensors, *, sent, step, micro_batch)  # the framework's own path
        .count_side(direction, nbytes), .raise_if_flagged(step, flush), .flagged, .clear_flags()
        .begin_step(), .commit(), .rollback(), .clear_micro_batches(), .stats, .state_dict()
    compressed_boundary(x, channel, *, slot=0, sample_ids=None, training=True, step=None) -> tensor
        # the single-process reference (autograd.Function): a model with it at every cut is what the
        # distributed engines compute
    codec_mode(cfg, direction, *, training, step), codec_settings(cfg), payload_nbytes(cfg, shape, dtype)
    NonFiniteStepError, NonFiniteError

Below the channel, one codec side each: ``BoundaryEncoder``/``BoundaryDecoder`` (``boundary.py``: EF,
EF21, EF-mixed and AQ-SGD state); payloads are one flat uint8 tensor of fixed size per (shape, dtype,
codec): see ``codecs.py`` for the layout (an 8-byte header whose first byte flags NaN/Inf seen by the
sender; the receiver checks its method and dtype bytes against its own). State semantics are in
``feedback.py`` and ``aqsgd.py``; the kernels (``ppq::`` ops) in ``ops.py``.
A new codec changes ``codecs.py`` (and ``config.py``'s ``CodecConfig``); nothing above the channel.
"""

from deepspeed_ppq.compress.boundary import BoundaryDecoder, BoundaryEncoder, NonFiniteError
from deepspeed_ppq.compress.channel import (
    DIRECTIONS,
    STAT_FIELDS,
    BoundaryChannel,
    Mode,
    NonFiniteStepError,
    codec_mode,
    codec_settings,
)
from deepspeed_ppq.compress.codecs import HEADER_NBYTES, payload_layout, payload_nbytes, topk_k
from deepspeed_ppq.compress.reference import compressed_boundary

__all__ = [
    "payload_nbytes",
    "payload_layout",
    "topk_k",
    "HEADER_NBYTES",
    "BoundaryChannel",
    "Mode",
    "codec_mode",
    "codec_settings",
    "DIRECTIONS",
    "STAT_FIELDS",
    "BoundaryEncoder",
    "BoundaryDecoder",
    "compressed_boundary",
    "NonFiniteError",
    "NonFiniteStepError",
]
