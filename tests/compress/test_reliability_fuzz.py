"""Fuzz: random bytes into every codec's decoder, random ``"ppq"`` sections into the config loader.

* Decoders: any byte string gives a decoded tensor (NaN-filled when flagged) or a ``ValueError`` naming
  what is wrong -- never another exception, and never an index outside the tensor (TopK indices are
  checked before they are used).
* Config: a section either loads (and round-trips through ``model_dump``) or raises ``PPQConfigError``
  naming a field of the section.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspeed_ppq.compress import BoundaryDecoder
from deepspeed_ppq.compress.codecs import DTYPE_ID, METHOD_ID
from deepspeed_ppq.config import CodecConfig, PPQConfigError, load_ppq_config

SHAPE = (2, 3, 8)
CODECS = {
    "int8": CodecConfig(method="quant", bits=8),
    "int2_group": CodecConfig(method="quant", bits=2, granularity="group", group_size=8),
    "fp8": CodecConfig(method="fp8"),
    "topk": CodecConfig(method="topk", topk_ratio=0.25),
    "topk_values": CodecConfig(method="topk", topk_ratio=0.25, reuse_indices=True),
}
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decoder(name: str) -> BoundaryDecoder:
    return BoundaryDecoder(CODECS[name], name=f"fuzz {name}",
                           direction="gradients" if name == "topk_values" else "activations")


@FUZZ
@given(name=st.sampled_from(sorted(CODECS)), data=st.data(), exact=st.booleans())
def test_random_payload_decodes_or_raises_value_error(name, data, exact):
    dec = _decoder(name)
    n = dec.nbytes(SHAPE, torch.float32)
    size = n if exact else data.draw(st.integers(0, 2 * n))
    raw = data.draw(st.binary(min_size=size, max_size=size))
    payload = torch.tensor(list(raw), dtype=torch.uint8)
    if exact:  # a valid header (random status), so the body reaches the kernels
        payload[0] = data.draw(st.sampled_from([0, 0, 0, 1]))
        payload[1] = METHOD_ID[CODECS[name].method]
        payload[4] = DTYPE_ID[torch.float32]
    indices = None
    if dec.values_only:
        k = int(data.draw(st.integers(1, 6)))
        indices = torch.tensor(data.draw(st.lists(st.integers(-30, 60), min_size=2 * k, max_size=2 * k)),
                               dtype=torch.int64).view(2, k)
    try:
        out = dec.decode(payload, SHAPE, torch.float32, indices=indices)
    except ValueError as err:
        assert "fuzz" in str(err) or "payload" in str(err) or "indices" in str(err), err
        return
    assert tuple(out.shape) == SHAPE
    if dec.last_nonfinite:
        assert torch.isnan(out).all()


_CODEC = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["none", "quant", "fp8", "topk", "zip", 3]),
    "bits": st.sampled_from([2, 4, 8, 3, "8"]),
    "topk_ratio": st.one_of(st.floats(-1, 2), st.just(float("nan"))),
    "error_feedback": st.sampled_from(["none", "ef", "ef21", "ef_mixed", "x"]),
    "granularity": st.sampled_from(["sample", "token", "group", "row"]),
})
_SECTION = st.fixed_dictionaries({}, optional={
    "activations": _CODEC,
    "gradients": _CODEC,
    "warmup_steps": st.integers(-3, 5),
    "nonfinite": st.sampled_from(["error", "skip", "ignore"]),
    "partition": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["parameters", "uniform", "explicit", "type:Block", "type:(Block", "x"]),
        "boundaries": st.lists(st.integers(-2, 9), max_size=4)}),
    "autotune": st.fixed_dictionaries({}, optional={
        "micro_batch_sizes": st.lists(st.integers(-2, 8), max_size=3),
        "schedules": st.lists(st.sampled_from(["1f1b", "zigzag"]), max_size=2),
        "memory_budget": st.sampled_from([1024, "512MiB", "lots", -5])}),
    "typo_field": st.integers(),
})


@FUZZ
@given(section=_SECTION)
def test_random_config_loads_and_round_trips_or_names_a_field(section):
    try:
        cfg = load_ppq_config(section)
    except PPQConfigError as err:
        msg = str(err)
        assert msg.startswith("invalid ppq config") and any(k in msg for k in section), msg
        return
    again = load_ppq_config(cfg.model_dump(mode="json"))
    assert again == cfg
