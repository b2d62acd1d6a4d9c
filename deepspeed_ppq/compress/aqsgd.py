"""AQ-SGD per-sample buffers, keyed by the sample's index in the dataset.

Each side of a boundary keeps, per training sample, the activation as the receiver last reconstructed
it (zero before the sample is first seen). The sender sends the compressed change ``x - buf``; both sides
then add the decoded change to ``buf``; the receiver's output is ``buf``. On first sight ``buf`` is zero,
so the sender compresses the value itself. Sender and receiver buffers stay identical because both add
the same decoded bytes.

Storage: ``memory`` (a dict of fp32 tensors) or ``disk`` (one numpy memmap of
``[num_samples, sample_numel]`` fp32 per boundary and side, zero-filled on creation), for datasets whose
buffers do not fit in RAM.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np
import torch

from deepspeed_ppq.config import AQSGDConfig, PPQConfigError

__all__ = ["SampleBuffers"]


class SampleBuffers:
    """fp32 buffers of one boundary side, one per training sample.

    Args:
        cfg: the AQ-SGD config (storage, path, num_samples).
        name: the boundary's name (used in the memmap file name and in errors).
        role: ``"send"`` or ``"recv"`` (sender and receiver may live in one process).
    """

    def __init__(self, cfg: AQSGDConfig, name: str, role: str):
        self.cfg = cfg
        self.name = name
        self.role = role
        self.sample_shape: tuple[int, ...] | None = None
        self._mem: dict[int, torch.Tensor] = {}
        self._map: np.memmap | None = None
        self._undo: list[tuple[list[int], Any]] | None = None  # (ids, old rows) since begin_step()
        if cfg.storage == "disk" and not (cfg.path and cfg.num_samples):
            raise ValueError("aqsgd.storage='disk' needs aqsgd.path and aqsgd.num_samples")

    @property
    def file(self) -> str | None:
        if self.cfg.storage != "disk":
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)
        return os.path.join(self.cfg.path, f"aqsgd.{safe}.{self.role}.f32")

    def _ids(self, sample_ids, sample_shape) -> list[int]:
        if sample_ids is None:
            raise ValueError(
                f"{self.name}: AQ-SGD needs sample_ids (each sample's index in the dataset) for every "
                "training micro-batch; the data path must supply them"
            )
        ids = [int(i) for i in torch.as_tensor(sample_ids).reshape(-1).tolist()]
        if self.sample_shape is None:
            self.sample_shape = tuple(sample_shape)
        elif tuple(sample_shape) != self.sample_shape:
            raise ValueError(
                f"{self.name}: AQ-SGD sample shape changed from {self.sample_shape} to "
                f"{tuple(sample_shape)}; per-sample buffers need a fixed activation shape per sample"
            )
        n = self.cfg.num_samples
        bad = [i for i in ids if i < 0 or (n is not None and i >= n)]
        if bad:
            raise ValueError(f"{self.name}: sample_ids {bad[:4]} are outside [0, aqsgd.num_samples={n})")
        return ids

    def _memmap(self) -> np.memmap:
        if self._map is None:
            os.makedirs(self.cfg.path, exist_ok=True)
            numel = math.prod(self.sample_shape)
            self._map = np.memmap(self.file, dtype=np.float32, mode="w+", shape=(self.cfg.num_samples, numel))
        return self._map

    def gather(self, sample_ids, sample_shape, device: torch.device | str = "cpu") -> torch.Tensor:
        """fp32 ``[B, *sample_shape]`` on ``device``: the buffers of these samples (zeros for unseen ones).

        Memory storage keeps each buffer where ``scatter`` got it (the activation's device), so a GPU
        engine makes no host copies; disk storage reads the memmap rows and moves them to ``device``.
        """
        ids = self._ids(sample_ids, sample_shape)
        if self.cfg.storage == "disk":
            rows = self._memmap()[np.asarray(ids)]
            return torch.from_numpy(np.ascontiguousarray(rows)).view(len(ids), *sample_shape).to(device)
        zero = None
        out = []
        for i in ids:
            t = self._mem.get(i)
            if t is None:
                zero = torch.zeros(sample_shape, device=device) if zero is None else zero
                t = zero
            out.append(t.to(device))
        return torch.stack(out)

    def scatter(self, sample_ids, values: torch.Tensor) -> None:
        """Store ``values[b]`` (fp32 ``[B, *sample_shape]``) as sample ``sample_ids[b]``'s buffer."""
        ids = self._ids(sample_ids, values.shape[1:])
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.name}: sample_ids repeat within one micro-batch: {ids}")
        v = values.detach().float()
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{self.name}: refusing to store NaN/Inf in AQ-SGD buffers of samples {ids[:4]}")
        if self._undo is not None:
            self._undo.append((ids, self._old_rows(ids)))
        if self.cfg.storage == "disk":
            m = self._memmap()
            m[np.asarray(ids)] = v.reshape(len(ids), -1).cpu().numpy()
            return
        for b, i in enumerate(ids):
            self._mem[i] = v[b].clone()

    def _old_rows(self, ids: list[int]):
        if self.cfg.storage == "disk":
            return np.array(self._memmap()[np.asarray(ids)])
        return [self._mem.get(i) for i in ids]

    def begin_step(self) -> None:
        """Start recording what ``scatter`` overwrites, so ``rollback`` can undo this step."""
        self._undo = []

    def commit(self) -> None:
        """Keep this step's updates (stop recording)."""
        self._undo = None

    def rollback(self) -> None:
        """Undo every ``scatter`` since ``begin_step`` (a skipped optimizer step: the buffers are as if the
        step's samples were never seen)."""
        for ids, old in reversed(self._undo or []):
            if self.cfg.storage == "disk":
                self._memmap()[np.asarray(ids)] = old
                continue
            for i, t in zip(ids, old):
                if t is None:
                    self._mem.pop(i, None)
                else:
                    self._mem[i] = t
        self._undo = None

    def state_dict(self) -> dict:
        """Plain tensors: ``sample_shape`` and ``aqsgd_rows`` (memory storage: the rows of the ids in
        ``aqsgd_ids``, in order; disk storage: every row of the file); empty while no sample is stored."""
        if self.sample_shape is None or (self.cfg.storage == "memory" and not self._mem):
            return {}
        out = {"sample_shape": torch.tensor(self.sample_shape, dtype=torch.int64)}
        if self.cfg.storage == "disk":
            out["aqsgd_rows"] = torch.from_numpy(np.array(self._memmap()))
            return out
        ids = sorted(self._mem)
        out["aqsgd_ids"] = torch.tensor(ids, dtype=torch.int64)
        out["aqsgd_rows"] = torch.stack([self._mem[i].cpu() for i in ids])
        return out

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        """Restore what ``state_dict`` gave (disk storage writes the rows into this run's file).

        Raises:
            PPQConfigError: the rows do not fit this run's file (``aqsgd.num_samples`` changed).
        """
        if "sample_shape" not in state:
            return
        self.sample_shape = tuple(int(v) for v in state["sample_shape"].tolist())
        rows = state["aqsgd_rows"]
        if self.cfg.storage == "disk":
            m = self._memmap()
            if tuple(m.shape) != tuple(rows.shape):
                raise PPQConfigError(f"{self.name}: the checkpoint's AQ-SGD buffers have shape "
                                     f"{tuple(rows.shape)}, this run's file {self.file} has {tuple(m.shape)} "
                                     "(aqsgd.num_samples changed?)")
            m[:] = rows.numpy()
            m.flush()
            return
        self._mem = {int(i): rows[j].to(device) for j, i in enumerate(state["aqsgd_ids"].tolist())}

    def __len__(self) -> int:
        return len(self._mem) if self.cfg.storage == "memory" else (self.cfg.num_samples or 0)
