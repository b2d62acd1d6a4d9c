"""Boundary codecs: payload sizes, EF/EF21/EF-mixed/AQ-SGD state, non-finite policy, compressed_boundary.

(The channel's own rules -- when to compress, index reuse by micro-batch, counters, non-finite stops --
are in test_channel.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ppq.compress import (
    BoundaryChannel,
    BoundaryDecoder,
    BoundaryEncoder,
    NonFiniteError,
    compressed_boundary,
    payload_nbytes,
)
from deepspeed_ppq.compress.codecs import DTYPE_ID, decode_from, encode_into, payload_layout
from deepspeed_ppq.compress.feedback import mixed_topk_indices
from deepspeed_ppq.config import AQSGDConfig, CodecConfig, PPQConfig

CODECS = (
    [CodecConfig(method="none")]
    + [
        CodecConfig(method="quant", bits=b, granularity=g, **({"group_size": 8} if g == "group" else {}))
        for b in (2, 4, 6, 8)
        for g in ("sample", "token", "group")
    ]
    + [
        CodecConfig(method="fp8", fp8_format=f, granularity=g)
        for f in ("e4m3", "e5m2")
        for g in ("sample", "token")
    ]
    + [CodecConfig(method="topk", topk_ratio=r) for r in (0.1, 0.5, 1.0)]
)


def _pair(cfg, aqsgd=None, direction="activations", nonfinite="error"):
    return (
        BoundaryEncoder(
            cfg, name="s0->1 " + direction, aqsgd=aqsgd, nonfinite=nonfinite, direction=direction
        ),
        BoundaryDecoder(cfg, name="s0->1 " + direction, aqsgd=aqsgd, direction=direction),
    )


@pytest.mark.parametrize("cfg", CODECS, ids=lambda c: f"{c.method}-{c.bits}-{c.granularity}-{c.topk_ratio}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_size_and_counters(cfg, dtype):
    x = torch.randn(3, 5, 33).to(dtype)
    enc, dec = _pair(cfg)
    p = enc.encode(x)
    assert p.dtype == torch.uint8 and p.numel() == payload_nbytes(cfg, x.shape, dtype) == enc.nbytes(
        x.shape, dtype
    )
    y = dec.decode(p, x.shape, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    if cfg.method == "none":
        assert torch.equal(y, x)
    elif cfg.method == "topk":
        k = max(1, int(cfg.topk_ratio * 165))
        assert ((y != 0).view(3, -1).sum(1) <= k).all() and torch.equal(enc.last_indices, dec.last_indices)
        kept = y.view(3, -1).gather(1, dec.last_indices)
        assert torch.equal(kept, x.view(3, -1).gather(1, dec.last_indices))
    else:
        rng = (x.float().amax() - x.float().amin()).item()
        bound = rng / (2 ** (cfg.bits if cfg.method == "quant" else 3)) + 0.02
        assert (y.float() - x.float()).abs().max().item() <= bound
    # the same message through a channel: the same bytes, counted
    ch = BoundaryChannel(PPQConfig(activations=cfg))
    wire = ch.send("activations", x)
    assert torch.equal(ch.recv("activations", wire, x.shape, dtype), y)
    st = ch.stats["activations"]
    raw = x.numel() * x.element_size()
    wire_bytes = raw if cfg.method == "none" else p.numel()  # codec none: x itself crosses
    assert (st["raw_bytes"], st["wire_bytes"], st["messages"]) == (raw, wire_bytes, 1)
    assert cfg.method == "none" or (st["encode_s"] > 0 and st["decode_s"] > 0)


def test_granularity_matters_with_outliers():
    x = torch.randn(4, 16, 64)
    x[:, :, 3] *= 100  # one outlier channel, as in a transformer's residual stream
    err = {}
    for g in ("sample", "token", "group"):
        sized = {"group_size": 16} if g == "group" else {}
        cfg = CodecConfig(method="quant", bits=4, granularity=g, **sized)
        enc, dec = _pair(cfg)
        y = dec.decode(enc.encode(x), x.shape, x.dtype)
        err[g] = (y - x)[:, :, 16:].pow(2).mean().item()  # error away from the outlier's group
    assert err["group"] < err["token"] <= err["sample"] * 1.01


def test_ef21_receiver_state_equals_sender():
    cfg = CodecConfig(method="quant", bits=2, error_feedback="ef21")
    enc, dec = _pair(cfg)
    x = torch.randn(2, 8, 16)
    errs = []
    for _ in range(6):
        y = dec.decode(enc.encode(x), x.shape, x.dtype)
        assert torch.equal(enc.state.buf, dec.state.buf)
        errs.append((y - x).abs().max().item())
    assert errs[-1] < errs[0] / 10  # a fixed input is approached geometrically


def test_ef_carries_error_into_next_message():
    cfg = CodecConfig(method="topk", topk_ratio=0.25, error_feedback="ef")
    enc, dec = _pair(cfg)
    xs = [torch.randn(2, 32) for _ in range(4)]
    sent = torch.zeros(2, 32)
    for x in xs:
        e_before = enc.state.get(x.shape).clone()
        y = dec.decode(enc.encode(x), x.shape, x.dtype)
        assert torch.allclose(enc.state.buf, x + e_before - y)
        sent += y
    # what was sent plus what is still owed equals what was given
    assert torch.allclose(sent + enc.state.buf, sum(xs), atol=1e-5)


def test_ef_mixed_takes_half_from_input_half_from_error():
    cfg = CodecConfig(method="topk", topk_ratio=0.25, error_feedback="ef_mixed")
    enc, dec = _pair(cfg)
    x = torch.zeros(1, 16)
    x[0, :8] = torch.arange(8.0) + 1
    dec.decode(enc.encode(x), x.shape, x.dtype)  # k=4: the 2 largest |x| (+2 of an all-zero e: lowest free)
    assert enc.last_indices.tolist() == [[0, 1, 6, 7]]
    e = enc.state.buf.clone()
    x2 = torch.zeros(1, 16)
    x2[0, 10:] = 100.0
    dec.decode(enc.encode(x2), x2.shape, x2.dtype)
    s1 = {10, 11}  # 2 of the tied largest |x2|, lowest indices first
    s2 = set(torch.topk(e[0].abs(), 2).indices.tolist())  # the 2 largest leftovers
    assert set(enc.last_indices[0].tolist()) == s1 | s2


@pytest.mark.parametrize(
    "cfg", [CodecConfig(method="quant", bits=2), CodecConfig(method="topk", topk_ratio=0.3)]
)
def test_aqsgd_memory_and_disk_identical(cfg, tmp_path):
    base = torch.randn(10, 4, 8)
    outs = {}
    for storage in ("memory", "disk"):
        q = AQSGDConfig(enabled=True, storage=storage, path=str(tmp_path / storage), num_samples=10)
        enc, dec = _pair(cfg, aqsgd=q)
        ys = []
        for epoch in range(3):
            for ids in ([1, 5, 7], [0, 2, 9]):
                x = base[ids] + 0.01 * epoch
                ys.append(dec.decode(enc.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids))
                assert torch.equal(enc.buffers.gather(ids, (4, 8)), dec.buffers.gather(ids, (4, 8)))
        outs[storage] = torch.stack(ys)
    assert torch.equal(outs["memory"], outs["disk"])
    # first sight compresses the value itself; later epochs send small changes and converge
    x_last = torch.cat([base[[1, 5, 7]], base[[0, 2, 9]]]) + 0.02
    err_first = (outs["memory"][:2].reshape(6, 4, 8) - (x_last - 0.02)).abs().mean()
    err_last = (outs["memory"][-2:].reshape(6, 4, 8) - x_last).abs().mean()
    assert err_last < err_first


def test_aqsgd_needs_sample_ids_and_warmup_fills_buffers(tmp_path):
    cfg = CodecConfig(method="quant", bits=2)
    q = AQSGDConfig(enabled=True)
    enc, dec = _pair(cfg, aqsgd=q)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="AQ-SGD needs sample_ids"):
        enc.encode(x)
    p = enc.encode(x, sample_ids=[3, 4], uncompressed=True)
    assert p.numel() == enc.nbytes(x.shape, x.dtype, uncompressed=True) == 8 + x.numel() * 4
    y = dec.decode(p, x.shape, x.dtype, sample_ids=[3, 4], uncompressed=True)
    assert torch.equal(y, x)
    y2 = dec.decode(enc.encode(x, sample_ids=[3, 4]), x.shape, x.dtype, sample_ids=[3, 4])
    assert torch.equal(y2, x)  # no change since warm-up: the buffers are exact


def test_eval_compression_follows_config():
    x = torch.randn(2, 40)
    raw = CodecConfig(method="quant", bits=8)  # eval_compressed is False for 8 bits
    enc, dec = _pair(raw)
    p = enc.encode(x, training=False)
    assert p.numel() == payload_nbytes(CodecConfig(), x.shape, x.dtype)
    assert torch.equal(dec.decode(p, x.shape, x.dtype, training=False), x)
    tk = CodecConfig(method="topk", topk_ratio=0.1, error_feedback="ef")  # eval_compressed: stateless
    enc, dec = _pair(tk)
    p = enc.encode(x, training=False)
    assert p.numel() == payload_nbytes(tk, x.shape, x.dtype) and enc.state.buf is None


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize(
    "cfg",
    [
        CodecConfig(method="quant", bits=4),
        CodecConfig(method="fp8"),
        CodecConfig(method="topk", error_feedback="ef21"),
    ],
)
def test_nonfinite_policy(policy, cfg):
    enc, dec = _pair(cfg, nonfinite=policy)
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    if policy == "error":
        with pytest.raises(NonFiniteError, match=r"s0->1 activations: NaN or Inf"):
            enc.encode(x)
        return
    p = enc.encode(x)
    assert enc.last_nonfinite and p[0] == 1
    y = dec.decode(p, x.shape, x.dtype)
    assert dec.last_nonfinite and torch.isnan(y).all()
    if enc.state.buf is not None:  # state untouched by a flagged message
        assert not torch.isnan(enc.state.buf).any()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="ef_mixed' needs method='topk'"):
        BoundaryEncoder(CodecConfig(method="quant", error_feedback="ef_mixed"), name="b")
    enc, dec = _pair(CodecConfig(method="quant", bits=4))
    with pytest.raises(ValueError, match="expected 24 uint8"):
        dec.decode(torch.zeros(5, dtype=torch.uint8), (1, 16), torch.float32)
    p = BoundaryEncoder(CodecConfig(method="fp8"), name="b").encode(torch.randn(1, 16))
    with pytest.raises(ValueError, match="expected"):
        dec.decode(p, (1, 16), torch.float32)
    gcfg = CodecConfig(method="topk")
    genc, _ = _pair(gcfg, direction="gradients")
    with pytest.raises(ValueError, match="pass indices="):
        genc.encode(torch.randn(2, 10))


@pytest.mark.parametrize("reuse", [True, False])
def test_compressed_boundary_gradients_match_manual(reuse):
    a = CodecConfig(method="topk", topk_ratio=0.25)
    g = CodecConfig(method="topk", topk_ratio=0.25, reuse_indices=reuse)
    ch = BoundaryChannel(PPQConfig(activations=a, gradients=g))
    x = torch.randn(3, 4, 8, requires_grad=True)
    w = torch.randn(3, 4, 8)
    y = compressed_boundary(x, ch)
    (y * w).sum().backward()
    if reuse:
        mask = y.detach() != 0  # the activation's TopK positions (randn values are never 0)
        assert mask.view(3, -1).sum(1).tolist() == [8, 8, 8]
        expected = torch.where(mask, w, 0.0)
        assert ch.stats["gradients"]["wire_bytes"] == payload_nbytes(g, x.shape, x.dtype, values_only=True)
    else:
        k = 8
        idx = torch.sort(w.view(3, -1).abs(), dim=1, descending=True, stable=True).indices[:, :k]
        expected = torch.zeros(3, 32).scatter_(1, idx, w.view(3, -1).gather(1, idx)).view_as(x)
    assert torch.equal(x.grad, expected)


def test_compressed_boundary_quant_gradient():
    a = CodecConfig(method="quant", bits=4)
    g = CodecConfig(method="quant", bits=8)
    x = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(2, 6, 16)
    y = compressed_boundary(x, BoundaryChannel(PPQConfig(activations=a, gradients=g)))
    (y * w).sum().backward()
    ge2, gd2 = _pair(g, direction="gradients")
    expected = gd2.decode(ge2.encode(w), w.shape, w.dtype)
    assert torch.equal(x.grad, expected)
    assert not torch.equal(y, x) and (y - x).abs().max() < 0.5


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    idx=st.integers(0, len(CODECS) - 1),
    scale=st.sampled_from([0.0, 1e-20, 1.0, 1e20]),
    seed=st.integers(0, 1000),
)
def test_property_any_shape(shape, idx, scale, seed):
    cfg = CODECS[idx]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    enc, dec = _pair(cfg)
    p = enc.encode(x)
    assert p.numel() == payload_nbytes(cfg, x.shape, x.dtype) and p[0] == 0
    y = dec.decode(p, x.shape, x.dtype)
    assert torch.isfinite(y).all()
    if cfg.method in ("none", "quant", "fp8"):
        assert (y - x).abs().max() <= x.abs().max() * 1.0 + 1e-30


# Codecs with state on both sides, so every allocation path (payload, decoded output, EF/EF21 buffers,
# EF-mixed selection, AQ-SGD per-sample buffers) is exercised on the tensor's own device.
DEVICE_CASES = {
    "quant8_token": (CodecConfig(method="quant", bits=8), None),
    "quant4_group_ef21": (CodecConfig(method="quant", bits=4, granularity="group", group_size=8,
                                      error_feedback="ef21"), None),
    "fp8_ef": (CodecConfig(method="fp8", error_feedback="ef"), None),
    "topk_ef_mixed": (CodecConfig(method="topk", topk_ratio=0.25, error_feedback="ef_mixed"), None),
    "quant2_aqsgd": (CodecConfig(method="quant", bits=2), AQSGDConfig(enabled=True)),
}


def _device_run(cfg, aq, device):
    """Three messages through one encoder/decoder pair on ``device``; payloads and outputs back on CPU."""
    enc, dec = _pair(cfg, aqsgd=aq)
    g = torch.Generator().manual_seed(0)
    payloads, outs = [], []
    for step in range(3):
        x = torch.randn(4, 3, 24, generator=g).to(device)
        ids = torch.tensor([0, 1, 2, 3]) + 2 * step
        p = enc.encode(x, sample_ids=ids)
        y = dec.decode(p, x.shape, x.dtype, sample_ids=ids)
        assert p.device == x.device and y.device == x.device
        payloads.append(p.cpu())
        outs.append(y.cpu())
    for side in (enc, dec):
        if side.state.buf is not None:
            assert side.state.buf.device.type == device
    return payloads, outs


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_codecs_stay_on_the_gpu_and_match_cpu(name):
    """Encode/decode on CUDA allocate on CUDA (no host copies) and give the CPU's bytes and values."""
    cfg, aq = DEVICE_CASES[name]
    cpu_p, cpu_y = _device_run(cfg, aq, "cpu")
    gpu_p, gpu_y = _device_run(cfg, aq, "cuda")
    for step, (a, b) in enumerate(zip(cpu_p, gpu_p)):
        # integer codes and packing are bit-exact across kernels; fp32 scales may differ in the last ulp
        assert a.numel() == b.numel() and a[:8].tolist() == b[:8].tolist(), (name, step)
        assert (a != b).float().mean().item() < 1e-3, (name, step)
    for a, b in zip(cpu_y, gpu_y):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_decoder_rejects_out_on_another_device():
    """``out=`` must live where the payload does (the engines pass their receive buffers)."""
    enc, dec = _pair(CodecConfig(method="quant", bits=8))
    x = torch.randn(2, 3, 8)
    p = enc.encode(x)
    with pytest.raises(ValueError, match="on the payload's device cpu, got torch.float32"):
        dec.decode(p, x.shape, x.dtype, out=torch.empty(2, 3, 8, device="meta"))


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_codecs_follow_the_tensor_device_on_cpu(name):
    """The device-following allocations give CPU tensors (and state) for CPU inputs."""
    cfg, aq = DEVICE_CASES[name]
    payloads, outs = _device_run(cfg, aq, "cpu")
    assert all(p.dtype == torch.uint8 for p in payloads) and all(torch.isfinite(y).all() for y in outs)


@pytest.mark.parametrize(
    "grad_cfg", [CodecConfig(method="quant", bits=4), CodecConfig(method="topk", topk_ratio=0.25)],
    ids=["quant4", "topk_reuse"])
def test_aqsgd_warmup_raw_activations_compressed_gradients(grad_cfg):
    """AQ-SGD warm-up (config.py: ``aqsgd.warmup_steps``): the activation crosses raw and fills the
    per-sample buffers on both sides; the gradient stays compressed, unless it reuses the activation's
    TopK indices, which a raw activation does not have (then it goes raw too)."""
    act_cfg = (CodecConfig(method="topk", topk_ratio=0.25) if grad_cfg.method == "topk"
               else CodecConfig(method="quant", bits=2))
    ppq = PPQConfig(activations=act_cfg, gradients=grad_cfg, aqsgd=AQSGDConfig(enabled=True, warmup_steps=1))
    ch = BoundaryChannel(ppq)
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    gy = torch.randn(4, 3, 16)
    ids = torch.arange(4)
    y = compressed_boundary(x, ch, sample_ids=ids, step=0)
    y.backward(gy)
    assert torch.equal(y, x)  # raw activation
    sides = ch.state_dict()["sides"]
    for side in ("send|activations|0", "recv|activations|0"):
        assert sides[side]["aqsgd_ids"].tolist() == [0, 1, 2, 3]
        assert torch.equal(sides[side]["aqsgd_rows"], x.detach())
    wire = ch.stats["gradients"]["wire_bytes"]
    if grad_cfg.method == "topk":
        assert torch.equal(x.grad, gy) and wire == payload_nbytes(CodecConfig(), gy.shape, gy.dtype)
    else:
        ref_e, ref_d = _pair(grad_cfg, direction="gradients")
        expect = ref_d.decode(ref_e.encode(gy), gy.shape, gy.dtype)
        assert torch.equal(x.grad, expect) and not torch.equal(x.grad, gy)
        assert wire == payload_nbytes(grad_cfg, gy.shape, gy.dtype)
    # after warm-up the next message is the compressed change (0.01 everywhere) against the filled buffers:
    # off by at most that change, where a value-sized error would be ~1
    y2 = compressed_boundary(x.detach() + 0.01, ch, sample_ids=ids, step=1)
    assert (y2 - (x.detach() + 0.01)).abs().max() < 0.0101


def test_encode_into_a_reused_buffer():
    """``encode(out=...)`` writes the same bytes as a fresh payload (engines reuse one per boundary)."""
    cfg = CodecConfig(method="quant", bits=4, error_feedback="ef")
    (e1, _), (e2, _) = _pair(cfg), _pair(cfg)
    buf = torch.full((e2.nbytes((2, 3, 8), torch.float32),), 255, dtype=torch.uint8)
    for _ in range(2):  # EF state moves on identically
        x = torch.randn(2, 3, 8)
        p = e2.encode(x, out=buf)
        assert p.data_ptr() == buf.data_ptr() and torch.equal(p, e1.encode(x))
    with pytest.raises(ValueError, match=r"out must be a contiguous uint8 tensor of \d+ bytes"):
        e2.encode(x, out=torch.empty(3, dtype=torch.uint8))


@pytest.mark.parametrize("method", ["none", "quant", "fp8", "topk"])
def test_payload_records_its_dtype_and_decode_checks_it(method):
    """fp16 and bf16 payloads are the same size: the header's dtype byte stops a decode as the other."""
    cfg = CodecConfig(method=method)
    x = torch.randn(2, 64, dtype=torch.float16)
    lay, as_bf16 = payload_layout(cfg, x.shape, x.dtype), payload_layout(cfg, x.shape, torch.bfloat16)
    assert lay.nbytes == as_bf16.nbytes
    payload = torch.empty(lay.nbytes, dtype=torch.uint8)
    encode_into(cfg, x, payload, lay)
    assert int(payload[4]) == DTYPE_ID[torch.float16]
    with pytest.raises(ValueError, match=r"encoded from torch.float16, the receiver decodes it as torch.bf"):
        decode_from(cfg, payload, as_bf16, torch.empty(2, 64, dtype=torch.bfloat16))
    payload[4] = 0  # a sender from before the dtype byte
    with pytest.raises(ValueError, match="no recorded dtype"):
        decode_from(cfg, payload, lay, torch.empty_like(x))


@pytest.mark.parametrize("method", ["none", "quant", "fp8", "topk"])
def test_encode_into_and_decode_from_check_tensors_against_the_layout(method):
    cfg = CodecConfig(method=method)
    lay = payload_layout(cfg, (4, 8), torch.bfloat16)
    payload = torch.empty(lay.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x is torch.float16 \(4, 8\); this payload layout is for torch.bf"):
        encode_into(cfg, torch.randn(4, 8, dtype=torch.float16), payload, lay)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"payload is torch.uint8 with {lay.nbytes + 4} elements"):
        encode_into(cfg, x, torch.empty(lay.nbytes + 4, dtype=torch.uint8), lay)
    encode_into(cfg, x, payload, lay)
    with pytest.raises(ValueError, match=r"out is torch.float16 \(4, 8\)"):
        decode_from(cfg, payload, lay, torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out is torch.bfloat16 \(8, 4\)"):
        decode_from(cfg, payload, lay, torch.empty(8, 4, dtype=torch.bfloat16))
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    decode_from(cfg, payload, lay, out)
    if method == "none":  # raw bytes: only the layout's own dtype
        assert torch.equal(out, x)
        with pytest.raises(ValueError, match=r"out is torch.float32"):
            decode_from(cfg, payload, lay, torch.empty(4, 8))
    else:  # the codec state decodes into fp32: the same values, unrounded
        wide = torch.empty(4, 8)
        decode_from(cfg, payload, lay, wide)
        assert torch.equal(wide.bfloat16(), out)


@pytest.mark.parametrize("ef", ["ef", "ef21", "ef_mixed"])
def test_topk_error_feedback_on_bf16(ef):
    """EF state decodes a bf16 TopK payload into fp32 (the C++ kernel takes one dtype: values are widened)."""
    enc, dec = _pair(CodecConfig(method="topk", topk_ratio=0.25, error_feedback=ef))
    for _ in range(2):
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        y = dec.decode(enc.encode(x), x.shape, x.dtype)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and enc.state.buf.dtype == torch.float32


def test_mixed_topk_indices_rejects_k_and_e_out_of_range():
    x = torch.randn(2, 4)
    assert mixed_topk_indices(x, torch.randn(2, 4), 4).tolist() == [[0, 1, 2, 3]] * 2
    for k in (5, 0):
        with pytest.raises(ValueError, match=rf"k={k} must lie in \[1, L=4\]"):
            mixed_topk_indices(x, torch.randn(2, 4), k)
    with pytest.raises(ValueError, match=r"e has shape \(2, 8\), it must match x's \[B, L\]=\[2, 4\]"):
        mixed_topk_indices(x, torch.randn(2, 8), 3)
