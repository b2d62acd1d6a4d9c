"""The PPQ pipeline engine on real DeepSpeed engines over 2 and 4 gloo ranks.

One multi-process run per world size carries every codec case (process start-up and the DeepSpeed
import cost seconds). Each case trains 3 steps and evaluates once; every rank compares its own
stage's gradients with a single-process model that applies the same codec at the same boundaries
(``compressed_boundary``), and the engine's byte counters with the codec's theory (``payload_nbytes``).
Codec "none" is stock DeepSpeed bit for bit: the same losses, and the same bytes in every parameter after
the steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.compress import payload_nbytes
from deepspeed_ppq.config import load_ppq_config

SCRIPT = ROOT / "tests" / "dist" / "ds_pipe.py"
MB, GAS, T, D, STEPS = 2, 2, 4, 16, 3


def _q(bits, **kw):
    return {"method": "quant", "bits": bits, **kw}


# name -> (ppq section, relative gradient tolerance, whether the case has a tuple activation).
# Tolerances: the distributed run performs the same float operations as the reference, so codes
# agree bit for bit and gradients came out identical (measured: 0, and 3e-7 for the tuple case whose
# two gradients DeepSpeed accumulates in another order). The 1e-5 slack allows float reassociation;
# a value pushed across a codec rounding edge would exceed it and fail the test, as it should.
CODEC_CASES = {
    "quant8": ({"activations": _q(8), "gradients": _q(8)}, 1e-5, False),
    "quant4_group": ({"activations": _q(4, granularity="group", group_size=8), "gradients": _q(8)},
                     1e-5, False),
    "quant2_sample": ({"activations": _q(2, granularity="sample"), "gradients": _q(4)}, 1e-5, False),
    "fp8": ({"activations": {"method": "fp8"}, "gradients": {"method": "fp8", "fp8_format": "e5m2"}},
            1e-5, False),
    "topk_reuse": ({"activations": {"method": "topk", "topk_ratio": 0.25},
                    "gradients": {"method": "topk", "topk_ratio": 0.25}}, 1e-5, False),
    "topk_own": ({"activations": {"method": "topk", "topk_ratio": 0.25},
                  "gradients": {"method": "topk", "topk_ratio": 0.5, "reuse_indices": False}}, 1e-5, False),
    "ef": ({"activations": _q(2, error_feedback="ef"), "gradients": _q(4, error_feedback="ef")}, 1e-5, False),
    "ef21": ({"activations": _q(4, error_feedback="ef21"), "gradients": _q(4, error_feedback="ef21")},
             1e-5, False),
    "ef_mixed": ({"activations": {"method": "topk", "topk_ratio": 0.25, "error_feedback": "ef_mixed"},
                  "gradients": {"method": "topk", "topk_ratio": 0.25, "reuse_indices": False,
                                "error_feedback": "ef_mixed"}}, 1e-5, False),
    "aqsgd": ({"activations": _q(4), "gradients": _q(8), "aqsgd": {"enabled": True}}, 1e-5, False),
    "tuple_quant8": ({"activations": _q(8), "gradients": _q(8)}, 1e-5, True),
    "warmup_quant4": ({"activations": _q(4), "gradients": _q(4), "warmup_steps": 1}, 1e-5, False),
    # AQ-SGD warm-up: activations raw while the per-sample buffers fill, gradients compressed (config.py) ...
    "aqsgd_warmup": ({"activations": _q(2), "gradients": _q(4),
                      "aqsgd": {"enabled": True, "warmup_steps": 1}}, 1e-5, False),
    # ... except TopK gradients reusing the activation's indices: a raw activation has none, so raw too
    "aqsgd_warmup_topk": ({"activations": {"method": "topk", "topk_ratio": 0.25},
                           "gradients": {"method": "topk", "topk_ratio": 0.25},
                           "aqsgd": {"enabled": True, "warmup_steps": 1}}, 1e-5, False),
    # ppq.warmup_steps with AQ-SGD: both directions raw, the activations' per-sample buffers fill
    "aqsgd_global_warmup": ({"activations": _q(4), "gradients": _q(8), "warmup_steps": 1,
                             "aqsgd": {"enabled": True}}, 1e-5, False),
}


BLOCKING_CASES = ("ef21", "topk_reuse", "tuple_quant8")


def _cases() -> list[dict]:
    cases = [{"name": "stock", "stock": True}, {"name": "none", "ppq": {}},
             {"name": "stock_tuple", "stock": True, "tuple": True},
             {"name": "none_tuple", "ppq": {}, "tuple": True}]
    cases += [{"name": n, "ppq": p, "tuple": t} for n, (p, _, t) in CODEC_CASES.items()]
    # the same codecs with blocking sends: overlapping sends must not change a single bit
    cases += [{"name": f"{n}_blocking", "ppq": CODEC_CASES[n][0], "tuple": CODEC_CASES[n][2],
               "overlap": False} for n in BLOCKING_CASES]
    return cases


def _wire_theory(ppq: dict, direction: str, tuple_act: bool, boundary: int) -> tuple[int, int]:
    """(messages, bytes) the codec's theory says one boundary carries over the whole run: compressed
    training steps at ``payload_nbytes``; warm-up steps, codec ``none`` and raw evaluation through
    DeepSpeed's own path at the tensor's bytes; AQ-SGD warm-up through the codec raw (plus its header)."""
    cfg = load_ppq_config(ppq)
    codec = cfg.activations if direction == "act" else cfg.gradients
    shape = (MB, T, D)
    raw = math.prod(shape) * 4
    n_float = 2 if tuple_act and boundary == 0 else 1
    values_only = direction == "grad" and codec.method == "topk" and codec.reuse_indices
    per_train = payload_nbytes(codec, shape, torch.float32, values_only=values_only) if codec.enabled else raw
    per_codec_raw = payload_nbytes(load_ppq_config({}).activations, shape, torch.float32)  # header + raw
    warm = min(cfg.warmup_steps, STEPS)
    aq_warm = min(max(cfg.aqsgd.warmup_steps - warm, 0), STEPS - warm) if cfg.aqsgd.enabled and \
        (direction == "act" or values_only) else 0
    # AQ-SGD activations go through the codec (raw) during ppq.warmup_steps too: the buffers must fill
    per_warm = per_codec_raw if cfg.aqsgd.enabled and direction == "act" else raw
    per_msg = [per_warm] * warm + [per_codec_raw] * aq_warm + [per_train] * (STEPS - warm - aq_warm)
    msgs = STEPS * GAS * n_float
    total = sum(per_msg) * GAS * n_float
    if direction == "act":  # one evaluation batch
        msgs += GAS * n_float
        per_eval = payload_nbytes(codec, shape, torch.float32) if codec.eval_compressed else raw
        total += GAS * n_float * per_eval
    return msgs, total


def _check_world(results: list[dict], world: int) -> None:
    for rank, res in enumerate(results):
        for base in ("none", "none_tuple"):
            stock = res["stock" if base == "none" else "stock_tuple"]
            assert res[base]["losses"] == stock["losses"], (rank, base)  # bit-identical to DeepSpeed
            assert res[base]["eval_loss"] == stock["eval_loss"]
            # and so are the parameters after the steps (this stage's, every byte)
            assert res[base]["params_sha256"] == stock["params_sha256"], (rank, base)
            # (the digest tells runs apart: a compressing codec trains other parameters)
            coded = res["quant8" if base == "none" else "tuple_quant8"]
            assert coded["params_sha256"] != stock["params_sha256"], (rank, base)
            for key, s in res[base]["stats"].items():  # measured on DeepSpeed's own send path
                b, d = key.split(".")
                msgs, total = _wire_theory({}, d, base == "none_tuple", int(b))
                assert (s["messages"], s["wire_bytes"], s["raw_bytes"]) == (msgs, total, total), (rank, key)
        for name in BLOCKING_CASES:  # non-blocking sends (the default) vs blocking: bit-identical
            a, b = res[name], res[f"{name}_blocking"]
            assert (a["losses"], a["eval_loss"]) == (b["losses"], b["eval_loss"]), (rank, name)
            assert {k: v["wire_bytes"] for k, v in a["stats"].items()} == \
                {k: v["wire_bytes"] for k, v in b["stats"].items()}, (rank, name)
        for name, (ppq, tol, tuple_act) in CODEC_CASES.items():
            r = res[name]
            assert r["grad_steps"] == STEPS and r["stage_params"] > 0, (rank, name)
            assert r["grad_rel_err"] <= tol, (rank, name, r["grad_rel_err"])
            for a, b in zip(r["losses"], r["ref_losses"]):
                assert math.isclose(a, b, rel_tol=tol, abs_tol=1e-6), (rank, name, r["losses"])
            assert math.isclose(r["eval_loss"], r["ref_eval_loss"], rel_tol=tol), (rank, name)
            # Compression really happened: the losses differ from the uncompressed run.
            assert r["losses"] != res["none_tuple" if tuple_act else "none"]["losses"], name
            for key, s in r["stats"].items():
                b, d = key.split(".")
                msgs, total = _wire_theory(ppq, d, tuple_act, int(b))
                assert (s["messages"], s["wire_bytes"]) == (msgs, total), (rank, name, key, s)
                assert s["wire_bytes"] < s["raw_bytes"], (name, key)


@pytest.mark.distributed
def test_codecs_match_reference_two_ranks(tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(_cases()))
    _check_world(run_ranks(SCRIPT, 2, [cases]), 2)


@pytest.mark.distributed
def test_codecs_match_reference_four_ranks(tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(_cases()))
    _check_world(run_ranks(SCRIPT, 4, [cases]), 4)
