"""The PPQ engine's own state in DeepSpeed checkpoints: codec state and what a resume must agree on.

``PPQPipelineEngine.save_checkpoint`` (:class:`CheckpointMixin`) writes, beside DeepSpeed's files, one
``ppq_state_rank<R>.pt`` per rank into ``<save_dir>/<tag>/`` (plain tensors, ints, floats and strings: it
loads with ``torch.load(weights_only=True)``). Format 3:

* ``settings``: JSON of what the run was set up with -- everything the start-up handshake compares
  (``integrations.handshake``: codec settings ``ppq.*``, boundary dtype, partition ``pipeline.*``, the
  precision policy ``weights.*`` -- rules, kept blocks, block size, scale dtype, double quantization, ... --
  and the plan's ``plan.fingerprint``), the format of each of this stage's Linear layers as the policy
  decided it (``linear_formats``) and the optimizer class;
* ``channels``: per boundary this rank talks over (``"0"``, ...), its ``BoundaryChannel.state_dict()``:
  ``sides`` (``"send|activations|0"``, ...: the EF/EF21 buffer, the AQ-SGD per-sample buffers with their
  sample ids -- memory storage: the ids seen and one row each; disk storage: every row of the memory-mapped
  file) and ``stats`` (the counters of ``ppq_stats``).

Older formats are still read. Format 2 recorded fewer settings (codecs, partition, ``weights.format``
and ``weights.master``, optimizer): only those are compared. Format 1 (before the channels) also keyed
``sides`` ``"enc|act|0"`` (with per-side counters, now dropped) and ``stats`` ``"<boundary>|act"``.
``load_checkpoint`` reads the file first and compares ``settings`` with the running engine: a resume into
a different partition, codec, precision policy, plan or optimizer stops with an error naming each field,
both values and how to convert, before DeepSpeed reports a generic state-dict mismatch.
"""

from __future__ import annotations

import json
import os
import warnings

import torch

from deepspeed_ppq.config import PPQConfigError
from deepspeed_ppq.integrations.handshake import flatten_settings

__all__ = ["FORMAT", "CheckpointMixin", "state_file", "resume_settings", "linear_formats", "save_codec_state",
           "load_codec_state", "check_resume", "read_state"]

FORMAT = 3
_READS = (1, 2, FORMAT)
_HOW = {
    "pipeline": "module weights are saved per layer, so load_checkpoint(..., load_module_only=True) "
                "restarts the optimizer and codec state on the new partition",
    "ppq": "start with the saved ppq codec settings, or load_checkpoint(..., load_module_only=True) to keep "
           "the weights and start the codec state (EF/EF21/AQ-SGD buffers) afresh",
    "boundary": "start with the saved precision (the DeepSpeed config's fp16/bf16 sections)",
    "weights": "start with the saved ppq.weights, or convert the weights first (quantized layers save a "
               "different state dict): load_checkpoint(..., load_module_only=True) into a run set up as "
               "saved, then save the module's weights and build the new set-up from them",
    "linear_formats": "the precision policy decides other formats for these Linear layers: start with the "
                      "saved ppq.weights (rules, keep_first_blocks/keep_last_blocks, format), or convert as "
                      "for weights",
    "plan": "start with the plan file the checkpoint was trained under (ppq.plan_file; the fingerprint "
            "above), or re-plan from the saved weights: load_checkpoint(..., load_module_only=True) in a run "
            "set up as saved, then save the module for the new plan",
    "optimizer": "start with the saved optimizer (its state has other keys), or load_checkpoint(..., "
                 "load_optimizer_states=False) to keep the weights and restart the optimizer",
}
# format 1: "enc|act|i" -> (which of the rank's boundaries: 0 its own, -1 the previous one, channel side key)
_V1_SIDES = {("enc", "act"): (0, "send|activations"), ("dec", "grad"): (0, "recv|gradients"),
             ("dec", "act"): (-1, "recv|activations"), ("enc", "grad"): (-1, "send|gradients")}
_V1_DIRECTIONS = {"act": "activations", "grad": "gradients"}


def state_file(ckpt_dir: str, tag: str, rank: int) -> str:
    return os.path.join(ckpt_dir, str(tag), f"ppq_state_rank{rank}.pt")


def linear_formats(module) -> dict[str, str]:
    """Each Linear layer of this stage (global names, e.g. ``"3.mlp.fc"``) and its weight format in force
    (``"none"``: the training dtype)."""
    from deepspeed_ppq.quant import QuantLinear

    return {name: m.format.value if isinstance(m, QuantLinear) else "none"
            for name, m in module.named_modules() if isinstance(m, (QuantLinear, torch.nn.Linear))}


def resume_settings(engine) -> dict:
    """What a resumed run must share with the saved one (see ``_HOW`` for how to convert each part)."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed may wrap it
    return {**engine._agreed_settings(), "linear_formats": linear_formats(engine.module),
            "optimizer": {"class": type(opt).__name__ if opt is not None else None}}


def save_codec_state(engine, save_dir: str, tag: str) -> str:
    """Write this rank's ``ppq_state_rank<R>.pt`` (see the module docstring); returns its path."""
    path = state_file(save_dir, tag, engine.global_rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    channels = {str(b): ch.state_dict() for b, ch in engine.ppq_channels.items()}
    torch.save({"format": FORMAT, "settings": json.dumps(resume_settings(engine), sort_keys=True),
                "channels": channels}, path)
    return path


def _v1_channels(engine, saved: dict) -> dict:
    """A format-1 file's content in format 2's ``channels`` layout."""
    out: dict = {}
    for key, st in saved["sides"].items():
        role, short, idx = key.split("|")
        offset, side = _V1_SIDES[(role, short)]
        b = engine.stage_id + offset
        out.setdefault(str(b), {"sides": {}, "stats": {}})["sides"][f"{side}|{idx}"] = st
    for key, vec in saved["stats"].items():
        b, short = key.split("|")
        if int(b) in engine.ppq_channels:
            fields = dict(zip(saved["stat_fields"], vec.tolist()))
            out.setdefault(b, {"sides": {}, "stats": {}})["stats"][_V1_DIRECTIONS[short]] = fields
    return out


def check_resume(engine, path: str, saved: dict) -> None:
    """Raise naming every field the running engine and the checkpoint disagree on, and how to convert."""
    now = resume_settings(engine)
    a, b = flatten_settings(json.loads(saved["settings"])), flatten_settings(now)
    # an older file recorded fewer settings: compare those it has
    keys = set(a) | set(b) if saved["format"] == FORMAT else set(a)
    diffs = [k for k in sorted(keys) if a.get(k) != b.get(k)]
    if not diffs:
        return
    lines = [f"{k}: checkpoint has {a.get(k)!r}, this run has {b.get(k)!r}" for k in diffs]
    hows = [f"{part}: {_HOW[part]}" for part in _HOW if any(k.startswith(part + ".") for k in diffs)]
    raise PPQConfigError(f"cannot resume from {path}: this run is set up differently\n  " + "\n  ".join(lines)
                         + "\nto convert:\n  " + "\n  ".join(hows))


def read_state(path: str) -> dict:
    """The content of a ``ppq_state_rank<R>.pt`` of format 1, 2 or 3.

    Raises:
        PPQConfigError: an unreadable file or another format, naming the file and what to do.
    """
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise PPQConfigError(f"{path}: not a readable ppq checkpoint state file ({type(err).__name__}: "
                             f"{err}); restore it from the run that saved it, or load_checkpoint(..., "
                             "load_module_only=True) to restart the codec state") from None
    version = saved.get("format") if isinstance(saved, dict) else None
    if version not in _READS:
        raise PPQConfigError(f"{path}: ppq checkpoint state format {version!r}, this deepspeed_ppq reads "
                             f"formats {', '.join(map(str, _READS))}; resume with the deepspeed_ppq that "
                             "wrote it, or "
                             "load_checkpoint(..., load_module_only=True) to restart the codec state")
    return saved


def load_codec_state(engine, saved: dict) -> None:
    """Restore the codec state and counters from ``saved`` (``read_state``) into ``engine``'s channels."""
    channels = _v1_channels(engine, saved) if saved["format"] == 1 else saved["channels"]
    for b, state in channels.items():
        ch = engine.ppq_channels.get(int(b))
        if ch is None:
            raise PPQConfigError(f"the checkpoint holds codec state of boundary {b}, which stage "
                                 f"{engine.stage_id} does not talk over (another partition?)")
        ch.load_state_dict(state, engine.device)


class CheckpointMixin:
    """``save_checkpoint``/``load_checkpoint`` of ``PPQPipelineEngine``: DeepSpeed's plus the codec state."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's ``save_checkpoint`` plus this rank's codec state and set-up, so a resume continues
        bit for bit."""
        tag = f"global_step{self.global_steps}" if tag is None else tag
        out = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                      save_latest=save_latest, **kwargs)
        save_codec_state(self, save_dir, str(tag))
        return out

    def load_checkpoint(self, load_dir, tag=None, load_module_only=False, **kwargs):
        """DeepSpeed's ``load_checkpoint``; first checks that this run is set up as the saved one
        (partition, codecs, precision policy and per-Linear formats, plan, optimizer; the error names what
        differs and how to convert),
        then restores the codec state (EF/EF21/AQ-SGD buffers, counters) unless ``load_module_only``."""
        if tag is None and os.path.isfile(os.path.join(load_dir, "latest")):
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        saved = None
        if tag is not None and not load_module_only:
            path = state_file(load_dir, tag, self.global_rank)
            if os.path.isfile(path):
                saved = read_state(path)
                check_resume(self, path, saved)
            elif self._compressing:
                warnings.warn(f"{path} is missing (a checkpoint saved without deepspeed_ppq?): the codec "
                              "state (EF/EF21/AQ-SGD buffers) starts afresh", RuntimeWarning, stacklevel=2)
        out = super().load_checkpoint(load_dir, tag=tag, load_module_only=load_module_only, **kwargs)
        if saved is not None and out[0] is not None:
            load_codec_state(self, saved)
        return out
