"""NaN/Inf at every phase, for every codec, on 2 real gloo ranks (tests/dist/ds_nonfinite.py).

Matrix: codec x {error, skip} x {warm-up, steady, eval} x {activation, gradient} (evaluation has no
gradient). Warm-up is ``ppq.warmup_steps`` (DeepSpeed's own uncompressed path) for the plain codecs and
``ppq.aqsgd.warmup_steps`` (raw through the codec, filling the per-sample buffers) for AQ-SGD. All cases
share one process group; each (codec, policy) is one engine.

* skip: the step is skipped on both ranks and leaves parameters, optimizer state and codec state
  (EF/EF21 buffers, AQ-SGD buffers) bit-identical to before it, i.e. as a run that never saw that batch;
  an injected evaluation never skips the next step; codec state is finite throughout.
* error: both ranks stop with ``NonFiniteStepError`` naming the stage, the boundary and the direction.
"""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "dist" / "ds_nonfinite.py"
WARM = 3
CODECS = {
    "int8": {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}},
    "int4_ef": {"activations": {"method": "quant", "bits": 4, "error_feedback": "ef"},
                "gradients": {"method": "quant", "bits": 8, "error_feedback": "ef"}},
    "ef21": {"activations": {"method": "quant", "bits": 4, "error_feedback": "ef21"},
             "gradients": {"method": "quant", "bits": 4, "error_feedback": "ef21"}},
    "fp8": {"activations": {"method": "fp8"}, "gradients": {"method": "fp8", "fp8_format": "e5m2"}},
    "topk_reuse": {"activations": {"method": "topk", "topk_ratio": 0.25},
                   "gradients": {"method": "topk", "topk_ratio": 0.25, "reuse_indices": True}},
    "topk_ef_mixed": {"activations": {"method": "topk", "topk_ratio": 0.25, "error_feedback": "ef_mixed"},
                      "gradients": {"method": "topk", "topk_ratio": 0.25, "reuse_indices": False,
                                    "error_feedback": "ef"}},
    "aqsgd": {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 8},
              "aqsgd": {"enabled": True, "warmup_steps": WARM}},
}
# skip: every injection is a skipped step (a skip counts as a step, so two injections fit in warm-up)
SKIP_EVENTS = ["clean", "act", "grad", "eval_act", "clean", "act", "grad", "eval_act", "clean"]
SKIP_PHASE = [None, "warm", "warm", "eval", None, "steady", "steady", "eval", None]
# error: an injection stops the step (no step counted); one micro-batch, so no message is left in flight
ERROR_EVENTS = ["act", "grad"] + ["clean"] * WARM + ["act", "grad", "eval_act", "clean"]
ERROR_PHASE = ["warm", "warm"] + [None] * WARM + ["steady", "steady", "eval", None]


def _ppq(codec: str, policy: str) -> dict:
    ppq = json.loads(json.dumps(CODECS[codec]))
    ppq["nonfinite"] = policy
    if "aqsgd" not in ppq:
        ppq["warmup_steps"] = WARM
    return ppq


def _cases() -> list[dict]:
    cases = []
    for codec in CODECS:
        cases.append({"name": f"{codec}/skip", "ppq": _ppq(codec, "skip"), "events": SKIP_EVENTS})
        cases.append({"name": f"{codec}/error", "ppq": _ppq(codec, "error"), "events": ERROR_EVENTS,
                      "gas": 1})
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("nonfinite") / "cases.json"
    path.write_text(json.dumps(_cases()))
    return run_ranks(SCRIPT, 2, [path])


def _warm_path(codec: str) -> str:
    return "codec-raw" if codec == "aqsgd" else "raw"


@pytest.mark.distributed
@pytest.mark.parametrize("codec", list(CODECS))
def test_skip_leaves_no_trace(results, codec):
    for rank, res in enumerate(results):
        events = res[f"{codec}/skip"]["events"]
        for ev, phase in zip(events, SKIP_PHASE):
            where = (rank, codec, ev)
            assert "error" not in ev, where
            assert ev["state_finite"] and ev["params_finite"], where
            if phase in ("warm", "steady"):
                # the case covers what it claims: warm-up goes raw, steady compressed
                assert ev["act_path"] == (_warm_path(codec) if phase == "warm" else "compressed"), where
                assert ev["skipped"] == 1 and ev["unchanged"], where
            elif phase == "eval":
                assert ev["skipped"] == 0 and ev["unchanged"], where
            else:  # a clean step trains, also right after an injected evaluation
                assert ev["skipped"] == 0 and not ev["unchanged"], where
        # both stages saw the same skips (stage 1's own gradients were finite in the "grad" steps)
        assert [e["skipped"] for e in events] == [e["skipped"] for e in results[0][f"{codec}/skip"]["events"]]


@pytest.mark.distributed
@pytest.mark.parametrize("codec", list(CODECS))
def test_error_stops_both_stages(results, codec):
    for rank, res in enumerate(results):
        events = res[f"{codec}/error"]["events"]
        for ev, phase in zip(events, ERROR_PHASE):
            where = (rank, codec, ev)
            assert ev["state_finite"] and ev["params_finite"], where
            if phase is None:
                assert "error" not in ev, where
                continue
            if phase != "eval":
                assert ev["act_path"] == (_warm_path(codec) if phase == "warm" else "compressed"), where
            err = ev.get("error", "")
            what = "gradients" if ev["event"] == "grad" else "activations"
            assert err.startswith("NonFiniteStepError"), where
            assert f"stage {rank}" in err and f"boundary 0 (stage 0 -> 1) {what}[0]" in err, where
            assert f"step {ev['global_step']}" in err and "ppq.nonfinite='skip'" in err, where
            assert ev["unchanged"], where
