"""Compressed P2P inside megatron-core's real pipeline schedules (2 gloo ranks, PP=2, TP=1).

One multi-process run (tests/mcore/p2p_ranks.py) goes through every case below; each rank compares
its layers' gradients with a single-process model that applies the same codec at each stage boundary
(``deepspeed_ppq.compress.compressed_boundary``), and reports the bytes it put on the wire. AQ-SGD
cases take the sample ids off the batches (tuples and dicts), send them with the activations, and go
through both warm-ups (``ppq.warmup_steps``, ``aqsgd.warmup_steps``) before compressing.
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.config import PPQConfigError

SCRIPT = ROOT / "tests" / "mcore" / "p2p_ranks.py"
SHAPE = (4, 2, 16)  # (seq, micro-batch, hidden) in p2p_ranks.py

CASES = [
    {"name": "none-install-batched", "ppq": {}, "route": "install", "batch": True},
    {"name": "none-explicit-unbatched", "ppq": {}, "route": "explicit", "batch": False},
    {"name": "quant8-install-batched", "route": "install", "batch": True,
     "ppq": {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}}},
    {"name": "quant4-ef_fp8-ef21-explicit-unbatched", "route": "explicit", "batch": False, "steps": 3,
     "ppq": {"activations": {"method": "quant", "bits": 4, "error_feedback": "ef"},
             "gradients": {"method": "fp8", "fp8_format": "e5m2", "error_feedback": "ef21"}}},
    {"name": "topk-ef_mixed_topk-reuse-indices", "route": "install", "batch": True,
     "ppq": {"activations": {"method": "topk", "topk_ratio": 0.25, "error_feedback": "ef_mixed"},
             "gradients": {"method": "topk", "topk_ratio": 0.25, "reuse_indices": True}}},
    {"name": "quant2-sample_quant6-group-warmup", "route": "explicit", "batch": True, "steps": 3,
     "ppq": {"warmup_steps": 1, "activations": {"method": "quant", "bits": 2, "granularity": "sample"},
             "gradients": {"method": "quant", "bits": 6, "granularity": "group", "group_size": 8}}},
    {"name": "fp8-e4m3-topk-own-indices", "route": "install", "batch": False,
     "ppq": {"activations": {"method": "fp8"},
             "gradients": {"method": "topk", "topk_ratio": 0.5, "reuse_indices": False,
                           "error_feedback": "ef"}}},
    # interleaved 1F1B with overlap_p2p_comm: receives are decoded when the schedule waits on them
    {"name": "interleaved-deferred-decode", "route": "install", "batch": False, "interleaved": True,
     "ppq": {"activations": {"method": "quant", "bits": 4},
             "gradients": {"method": "topk", "topk_ratio": 0.5, "reuse_indices": False}}},
    # AQ-SGD: (x, y, sample_ids) batches; step 0 fills the per-sample buffers (activations raw), then the
    # activations carry compressed changes while the gradients keep their own EF
    {"name": "aqsgd-quant2-ef_quant8-install-batched", "route": "install", "batch": True, "steps": 3,
     "ppq": {"activations": {"method": "quant", "bits": 2},
             "gradients": {"method": "quant", "bits": 8, "error_feedback": "ef"},
             "aqsgd": {"enabled": True, "warmup_steps": 1}}},
    # dict batches; step 0 ppq.warmup_steps (gradients the tensor itself), step 1 AQ-SGD's warm-up (TopK
    # gradients reusing indices go raw through the codec: a raw activation has none), then compressed
    {"name": "aqsgd-topk-reuse-dict-explicit-unbatched", "route": "explicit", "batch": False, "steps": 4,
     "dict_batches": True,
     "ppq": {"warmup_steps": 1, "activations": {"method": "topk", "topk_ratio": 0.25},
             "gradients": {"method": "topk", "topk_ratio": 0.25, "reuse_indices": True},
             "aqsgd": {"enabled": True, "warmup_steps": 2}}},
]
MB = SHAPE[1]


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(SCRIPT, 2, [json.dumps(CASES)], timeout=400)
    return {r["rank"]: {c["name"]: c for c in r["cases"]} for r in ranks}


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_gradients_match_single_process_reference(results, case):
    lossy = bool(case["ppq"].get("activations") or case["ppq"].get("gradients"))
    for rank in (0, 1):
        r = results[rank][case["name"]]
        assert r["max_diff"] <= 1e-6 * r["max_grad"], (rank, r)
        if lossy:  # the reference with codecs is far from the uncompressed one: the codec really ran
            assert r["max_diff_uncompressed"] > 1e-5 * r["max_grad"], (rank, r)
            assert r["max_diff_uncompressed"] > 100 * max(r["max_diff"], 1e-12), (rank, r)
        assert r["steps_seen"] == case.get("steps", 2)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bytes_on_wire_equal_payload_nbytes(results, case):
    from deepspeed_ppq.compress import payload_nbytes
    from deepspeed_ppq.config import load_ppq_config

    cfg = load_ppq_config(case["ppq"])
    steps = case.get("steps", 2)
    raw = torch.Size(SHAPE).numel() * 4
    codec_raw = payload_nbytes(load_ppq_config({}).activations, SHAPE, torch.float32)  # header + raw
    total = 0
    for rank in (0, 1):
        r = results[rank][case["name"]]
        total += r["raw_bytes"]["activations"] + r["raw_bytes"]["gradients"]
        for direction in ("activations", "gradients"):
            c = getattr(cfg, direction)
            per_step = r["raw_bytes"][direction] // raw // steps
            if not c.enabled:
                assert r["wire_bytes"][direction] == r["raw_bytes"][direction]
                continue
            values_only = direction == "gradients" and c.method == "topk" and c.reuse_indices
            payload = payload_nbytes(c, SHAPE, torch.float32, values_only=values_only)
            expect = 0
            for step in range(steps):
                warm = step < cfg.warmup_steps
                aq_warm = cfg.aqsgd.enabled and step < max(cfg.warmup_steps, cfg.aqsgd.warmup_steps)
                if direction == "activations" and cfg.aqsgd.enabled:  # through the codec, ids in front
                    size = (codec_raw if aq_warm else payload) + 8 * MB
                else:
                    size = raw if warm else codec_raw if aq_warm and values_only else payload
                expect += per_step * size
            assert r["wire_bytes"][direction] == expect, (rank, direction, r)
            assert payload < raw
    boundaries = 3 if case.get("interleaved") else 1  # stage boundaries the model's chunks have
    assert total == boundaries * 2 * steps * 4 * raw  # each of 4 micro-batches, both directions, every step


def test_aqsgd_outside_a_wrapped_schedule_names_the_way_in():
    """The first stage takes sample ids off the batches only inside a wrapped schedule: say so."""
    from deepspeed_ppq.config import load_ppq_config
    from megatron_patches.p2p_state import BoundaryCodecs

    cfg = load_ppq_config({"activations": {"method": "quant", "bits": 4}, "aqsgd": {"enabled": True}})
    with pytest.raises(PPQConfigError, match=r"ppq_forward_backward_func\(\) or with install_compressed_p2p"):
        BoundaryCodecs(cfg, 0, 2).send("activations", torch.randn(*SHAPE), training=True)
    # evaluation needs no ids: it is stateless (4-bit activations are compressed there too)
    wire = BoundaryCodecs(cfg, 0, 2).send("activations", torch.ones(*SHAPE), training=False)
    assert wire.dtype == torch.uint8
