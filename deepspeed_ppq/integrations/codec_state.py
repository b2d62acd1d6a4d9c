"""The PPQ engine's own state in DeepSpeed checkpoints: codec state and what a resume must agree on.

``PPQPipelineEngine.save_checkpoint`` writes, beside DeepSpeed's files, one ``ppq_state_rank<R>.pt`` per
rank into ``<save_dir>/<tag>/`` (plain tensors, ints, floats and strings: it loads with
``torch.load(weights_only=True)``):

* ``settings``: JSON of what the run was set up with -- the codec settings and partition (the start-up
  handshake's ``ppq.*``/``pipeline.*``), the weight format and the optimizer class;
* ``sides``: per encoder/decoder (``"enc|act|0"``, ...): the EF/EF21 buffer, the AQ-SGD per-sample
  buffers with their sample ids (memory storage: the ids seen and one row each; disk storage: every row
  of the memory-mapped file), and the message/byte counters;
* ``stats``: the engine's per-boundary counters (``ppq_stats``).

``load_checkpoint`` reads this file first and compares ``settings`` with the running engine: a resume
into a different partition, codec, weight format or optimizer stops with an error naming each field,
both values and how to convert, before DeepSpeed reports a generic state-dict mismatch.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from deepspeed_ppq.config import PPQConfigError

__all__ = ["state_file", "resume_settings", "save_codec_state", "load_codec_state", "check_resume"]

_HOW = {
    "pipeline": "module weights are saved per layer, so load_checkpoint(..., load_module_only=True) "
                "restarts the optimizer and codec state on the new partition",
    "ppq": "start with the saved ppq codec settings, or load_checkpoint(..., load_module_only=True) to keep "
           "the weights and start the codec state (EF/EF21/AQ-SGD buffers) afresh",
    "weights": "convert the weights first (quantized layers save a different state dict), or start with the "
               "saved ppq.weights",
    "optimizer": "start with the saved optimizer (its state has other keys), or load_checkpoint(..., "
                 "load_optimizer_states=False) to keep the weights and restart the optimizer",
}


def state_file(ckpt_dir: str, tag: str, rank: int) -> str:
    return os.path.join(ckpt_dir, str(tag), f"ppq_state_rank{rank}.pt")


def resume_settings(engine) -> dict:
    """What a resumed run must share with the saved one (see ``_HOW`` for how to convert each part)."""
    agreed = engine._agreed_settings()
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed may wrap it
    return {**agreed, "weights": {"format": engine.ppq.weights.format.value,
                                  "master": str(getattr(engine.ppq.weights, "master", ""))},
            "optimizer": {"class": type(opt).__name__ if opt is not None else None}}


def _side_state(side) -> dict:
    out: dict = {"counters": torch.tensor([side.raw_bytes, side.wire_bytes, side.messages],
                                          dtype=torch.int64),
                 "codec_seconds": float(side.codec_seconds)}
    if side.state.buf is not None:
        out["feedback"] = side.state.buf.detach().cpu().clone()
    b = side.buffers
    if b is not None and b.sample_shape is not None:
        out["sample_shape"] = torch.tensor(b.sample_shape, dtype=torch.int64)
        if b.cfg.storage == "disk":
            out["aqsgd_rows"] = torch.from_numpy(np.array(b._memmap()))
        else:
            ids = sorted(b._mem)
            out["aqsgd_ids"] = torch.tensor(ids, dtype=torch.int64)
            out["aqsgd_rows"] = torch.stack([b._mem[i].cpu() for i in ids]) if ids else torch.empty(0)
    return out


def _restore_side(side, st: dict, device) -> None:
    raw, wire, msgs = (int(v) for v in st["counters"].tolist())
    side.raw_bytes, side.wire_bytes, side.messages = raw, wire, msgs
    side.codec_seconds = float(st["codec_seconds"])
    side.state.buf = st["feedback"].to(device) if "feedback" in st else None
    b = side.buffers
    if b is None or "sample_shape" not in st:
        return
    b.sample_shape = tuple(int(v) for v in st["sample_shape"].tolist())
    rows = st["aqsgd_rows"]
    if b.cfg.storage == "disk":
        m = b._memmap()
        if tuple(m.shape) != tuple(rows.shape):
            raise PPQConfigError(f"{b.name}: the checkpoint's AQ-SGD buffers have shape "
                                 f"{tuple(rows.shape)}, this run's file {b.file} has {tuple(m.shape)} "
                                 "(aqsgd.num_samples changed?)")
        m[:] = rows.numpy()
        m.flush()
    else:
        b._mem = {int(i): rows[j].to(device) for j, i in enumerate(st["aqsgd_ids"].tolist())}


def save_codec_state(engine, save_dir: str, tag: str) -> str:
    """Write this rank's ``ppq_state_rank<R>.pt`` (see the module docstring); returns its path."""
    sides = {}
    for prefix, table in (("enc", engine._encoders), ("dec", engine._decoders)):
        for (direction, idx), side in table.items():
            sides[f"{prefix}|{direction}|{idx}"] = _side_state(side)
    stats = {f"{b}|{d}": torch.tensor([v[f] for f in sorted(v)], dtype=torch.float64)
             for (b, d), v in engine._stats.items()}
    path = state_file(save_dir, tag, engine.global_rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fields = sorted(next(iter(engine._stats.values()), {}))
    torch.save({"format": 1, "settings": json.dumps(resume_settings(engine), sort_keys=True),
                "sides": sides, "stats": stats, "stat_fields": fields}, path)
    return path


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume(engine, path: str, saved: dict) -> None:
    """Raise naming every field the running engine and the checkpoint disagree on, and how to convert."""
    now = resume_settings(engine)
    a, b = _flatten(json.loads(saved["settings"])), _flatten(now)
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not diffs:
        return
    lines = [f"{k}: checkpoint has {a.get(k)!r}, this run has {b.get(k)!r}" for k in diffs]
    hows = [f"{part}: {_HOW[part]}" for part in _HOW if any(k.startswith(part + ".") for k in diffs)]
    raise PPQConfigError(f"cannot resume from {path}: this run is set up differently\n  " + "\n  ".join(lines)
                         + "\nto convert:\n  " + "\n  ".join(hows))


def read_state(path: str) -> dict:
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise PPQConfigError(f"{path}: not a readable ppq checkpoint state file ({type(err).__name__}: "
                             f"{err}); restore it from the run that saved it, or load_checkpoint(..., "
                             "load_module_only=True) to restart the codec state") from None


def load_codec_state(engine, saved: dict) -> None:
    """Restore the codec state and counters from ``saved`` (``read_state``) into ``engine``."""
    for key, st in saved["sides"].items():
        prefix, direction, idx = key.split("|")
        side = (engine._encoder if prefix == "enc" else engine._decoder)(direction, int(idx))
        _restore_side(side, st, engine.device)
    fields = saved["stat_fields"]
    for key, vec in saved["stats"].items():
        b, d = key.split("|")
        if (int(b), d) in engine._stats:
            engine._stats[(int(b), d)] = dict(zip(fields, vec.tolist()))
