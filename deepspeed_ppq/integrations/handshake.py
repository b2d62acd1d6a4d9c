"""Start-up agreement between adjacent pipeline stages (a mixin of ``PPQPipelineEngine``).

Each stage sends its neighbours what both sides of a boundary must agree on -- the codec settings
(``ppq.*``) and the partition (``pipeline.*``: boundaries, layer and stage count) -- as JSON with a length
prefix, and compares (SHA-256 first). On any difference both sides stop with ``CodecMismatchError``
naming each field and both values: before this, ranks built with different boundaries trained a wrong
model silently.
"""

from __future__ import annotations

import hashlib
import json

import torch
from deepspeed.runtime.pipe import p2p

from deepspeed_ppq.compress import codec_settings

__all__ = ["CodecMismatchError", "codec_settings", "flatten_settings", "HandshakeMixin"]


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


class HandshakeMixin:
    """``_handshake`` for ``PPQPipelineEngine`` (uses its ``ppq``, ``module``, stage ids)."""

    def _agreed_settings(self) -> dict:
        """What both sides of a boundary must agree on: the codec settings (``ppq.*``) and the partition
        (``pipeline.*``: boundaries, layer and stage count), so ranks built differently stop at start-up
        instead of computing a wrong model."""
        parts = [int(p) for p in getattr(self.module, "parts", [])]
        return {"ppq": codec_settings(self.ppq),
                "pipeline": {"parts": parts, "num_layers": len(getattr(self.module, "_layer_specs", [])),
                             "num_stages": self.num_stages}}

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
                "with the same ppq activations/gradients/aqsgd/warmup_steps/nonfinite settings and the same "
                "partition (pipeline.parts: build every rank's module with the same layers and boundaries, "
                "e.g. PPQPipelineModule.from_config with one config):\n  " + "\n  ".join(diffs)]
