"""Start-up agreement between adjacent pipeline stages (a mixin of ``PPQPipelineEngine``).

Each stage sends its neighbours what both sides of a boundary must agree on, as JSON with a length
prefix, and compares (SHA-256 first):

* ``ppq.*``: the codec settings (each boundary tensor's codec, warm-ups, AQ-SGD, the non-finite policy);
* ``boundary.dtype``: the dtype the engine computes, hence sends, every boundary tensor in (``fp32``,
  ``bf16``, ``fp16``). The shapes travel in DeepSpeed's own tensor meta on the first send, and the
  receiver allocates from the sender's, so they cannot disagree;
* ``pipeline.*``: the partition (boundaries, layer and stage count);
* ``weights.*``: the precision policy in force (format, rules, kept blocks, block size, scale dtype,
  double quantization, ...): it decides each Linear's format over the whole model ("the first N blocks"
  are global), so a stage built with another policy computes another model;
* ``plan.fingerprint``: the tuned plan the stage was built from (``plan_fingerprint``), or ``None``.

On any difference both sides stop with ``CodecMismatchError`` naming each field and both values: before
this, ranks built with different boundaries trained a wrong model silently. ``integrations.codec_state``
saves the same settings with each checkpoint and compares them on resume.
"""

from __future__ import annotations

import hashlib
import json

import torch
from deepspeed.runtime.pipe import p2p

from deepspeed_ppq.compress import codec_settings
from deepspeed_ppq.config import WeightsConfig

__all__ = ["CodecMismatchError", "codec_settings", "flatten_settings", "plan_fingerprint", "weight_settings",
           "HandshakeMixin"]


class CodecMismatchError(RuntimeError):
    """Two adjacent stages were started with different codec settings or partitions."""


def flatten_settings(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: settings compared field by field."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_settings(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plan_fingerprint(plan) -> str | None:
    """A digest of what a tuned ``Plan`` runs: the model it was made for, the world size, schedule,
    batch sizes, recomputation per stage and the ``"ppq"`` section (partition, weights, optimizer
    states, codecs); its notes, predictions and measurements leave it unchanged (ranks that planned
    the same plan time their planning differently). ``None`` without a plan."""
    if plan is None:
        return None
    runs = {"model": plan.model_fingerprint.get("digest"), "world_size": plan.world_size,
            "schedule": plan.schedule, "deepspeed": plan.deepspeed_config()}
    return hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]


def weight_settings(module, cfg) -> dict:
    """The precision policy in force on ``module``: the ``weights=`` a ``PPQPipelineModule`` was built with
    when they convert anything, else the config's ``ppq.weights`` (which ``initialize`` applies), as JSON."""
    w = getattr(module, "ppq_weights", None)
    if isinstance(w, dict):
        w = WeightsConfig.model_validate(w)
    if w is None or (w.format.value == "none" and not w.rules):
        w = cfg.weights
    return w.model_dump(mode="json")


class HandshakeMixin:
    """``_handshake`` for ``PPQPipelineEngine`` (uses its ``ppq``, ``module``, stage ids)."""

    def _agreed_settings(self) -> dict:
        """What both sides of a boundary must agree on (see the module docstring), so ranks built
        differently stop at start-up instead of computing a wrong model."""
        parts = [int(p) for p in getattr(self.module, "parts", [])]
        dtype = "fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32"
        return {"ppq": codec_settings(self.ppq), "boundary": {"dtype": dtype},
                "pipeline": {"parts": parts, "num_layers": len(getattr(self.module, "_layer_specs", [])),
                             "num_stages": self.num_stages},
                "weights": weight_settings(self.module, self.ppq),
                "plan": {"fingerprint": plan_fingerprint(getattr(self.module, "ppq_plan", None))}}

    def _handshake(self) -> None:
        """Exchange the agreed settings with both neighbours; stop both sides on a mismatch."""
        mine = self._agreed_settings()
        blob = json.dumps(mine, sort_keys=True).encode()
        problems = []
        # Boundary with the previous stage first, then the next: a chain, so no deadlock.
        if not self.is_first_stage():
            theirs = self._exchange_blob(self.prev_stage, blob, send_first=False)
            problems += self._compare(mine, theirs, self.prev_stage)
        if not self.is_last_stage():
            theirs = self._exchange_blob(self.next_stage, blob, send_first=True)
            problems += self._compare(mine, theirs, self.next_stage)
        if problems:
            raise CodecMismatchError("\n".join(problems))

    def _exchange_blob(self, peer: int, blob: bytes, send_first: bool) -> bytes:
        def send():
            p2p.send(torch.tensor([len(blob)], dtype=torch.int64, device=self.device), peer)
            p2p.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), peer)

        def recv() -> bytes:
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            p2p.recv(n, peer)
            buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.device)
            p2p.recv(buf, peer)
            return bytes(buf.cpu().numpy().tobytes())

        if send_first:
            send()
            return recv()
        out = recv()
        send()
        return out

    def _compare(self, mine: dict, theirs_blob: bytes, peer: int) -> list[str]:
        theirs = json.loads(theirs_blob)
        if hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).digest() == \
                hashlib.sha256(theirs_blob).digest():
            return []
        a, b = flatten_settings(mine), flatten_settings(theirs)
        diffs = [f"{k}: stage {self.stage_id} has {a.get(k)!r}, stage {peer} has {b.get(k)!r}"
                 for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        lo, hi = sorted((self.stage_id, peer))
        return [f"settings differ across boundary {lo} (stage {lo} -> {hi}); every stage must be started "
                "with the same ppq activations/gradients/aqsgd/warmup_steps/nonfinite settings, precision "
                "(fp16/bf16), partition and ppq.weights, and from the same plan file if any (build every "
                "rank's module with the same layers from one config, e.g. PPQPipelineModule.from_config):"
                "\n  " + "\n  ".join(diffs)]
