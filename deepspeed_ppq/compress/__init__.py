"""Activation/gradient codecs for pipeline stage boundaries, with their error-feedback state.

The API the engines (DeepSpeed ``PipelineEngine``, megatron-core P2P) code against::

    payload_nbytes(cfg, shape, dtype, *, values_only=False) -> int   # exact payload size
    BoundaryEncoder(cfg, *, name, aqsgd=None, nonfinite="error", direction="activations")
        .encode(x, *, training=True, sample_ids=None, indices=None, uncompressed=False) -> uint8 payload
        .nbytes(shape, dtype, *, training=True, uncompressed=False) -> int
        .last_indices, .last_nonfinite, .raw_bytes, .wire_bytes, .codec_seconds, .messages
    BoundaryDecoder(cfg, *, name, aqsgd=None, direction="activations")
        .decode(payload, shape, dtype, *, training=True, sample_ids=None, indices=None, out=None,
                uncompressed=False) -> tensor
        .nbytes(...), .last_indices, .last_nonfinite, counters as above
    compressed_boundary(x, act_enc, act_dec, grad_enc, grad_dec, *, sample_ids=None, training=True,
                        uncompressed=False, activations_uncompressed=False) -> tensor
        # single-process reference (autograd.Function); uncompressed: ppq.warmup_steps (both directions
        # raw); activations_uncompressed: AQ-SGD warm-up (activations raw, gradients compressed)
    NonFiniteError

Payloads are one flat uint8 tensor of fixed size per (shape, dtype, codec): see ``codecs.py`` for the
layout (an 8-byte header whose first byte flags NaN/Inf seen by the sender). State semantics (EF, EF21,
EF-mixed, AQ-SGD) are in ``feedback.py`` and ``aqsgd.py``; the kernels (``ppq::`` ops) in ``ops.py``.

TopK index reuse across processes: stage s's activation encoder keeps ``last_indices`` for micro-batch
i; stage s+1's activation decoder exposes the decoded ``last_indices``; stage s+1's gradient encoder
(``direction="gradients"``) is called with ``indices=`` those decoded indices and sends values only;
stage s's gradient decoder is called with ``indices=`` the kept ones.
"""

from deepspeed_ppq.compress.boundary import (
    BoundaryDecoder,
    BoundaryEncoder,
    NonFiniteError,
    compressed_boundary,
)
from deepspeed_ppq.compress.codecs import HEADER_NBYTES, payload_layout, payload_nbytes, topk_k

__all__ = [
    "payload_nbytes",
    "payload_layout",
    "topk_k",
    "HEADER_NBYTES",
    "BoundaryEncoder",
    "BoundaryDecoder",
    "compressed_boundary",
    "NonFiniteError",
]
