"""Codec kernels: C++ == reference bit for bit for codes/packing, error bounds, opcheck, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ppq.compress import ops
from deepspeed_ppq.ops import has_kernel, registered_ops

REF = registered_ops()
native = pytest.mark.skipif(not has_kernel("quant_encode"), reason="C++ extension not built (make build)")


def _quant_bufs(R, d, group, bits):
    G = R * math.ceil(d / group)
    return (
        torch.empty(G),
        torch.empty(G),
        torch.empty(ops.packed_nbytes(R * d, bits), dtype=torch.uint8),
        torch.empty(1, dtype=torch.uint8),
    )


def _quant(fn, x, group, bits):
    b = _quant_bufs(*x.shape, group, bits)
    fn(x, group, bits, *b)
    return b


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("shape,group", [((7, 33), 33), ((3, 50), 16), ((1, 13), 13), ((5, 8), 3)])
def test_pack_roundtrip_reference(bits, shape, group):
    n = shape[0] * shape[1]
    q = torch.randint(0, 1 << bits, (n,))
    p = ops.pack_codes_reference(q, bits)
    assert p.numel() == ops.packed_nbytes(n, bits)
    assert torch.equal(ops.unpack_codes_reference(p, bits, n), q.to(torch.int32))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize(
    "shape,group",
    [
        ((7, 33), 33),
        ((4, 64), 16),
        ((3, 50), 16),
        ((2, 4096), 4096),
        ((2, 4096), 2048),
        ((3, 4099), 4099),
        ((5, 9), 4),
        ((1, 1), 1),
    ],
)
def test_quant_cpp_equals_reference(dtype, bits, shape, group):
    torch.manual_seed(bits * 100 + shape[1])
    x = (torch.randn(shape) * torch.logspace(-2, 2, shape[1])).to(dtype)
    ref = _quant(REF["quant_encode"], x, group, bits)
    cpp = _quant(ops.quant_encode, x, group, bits)
    for a, b in zip(ref, cpp):
        assert torch.equal(a, b)
    out_ref, out_cpp = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    REF["quant_decode"](ref[2], ref[0], ref[1], group, bits, out_ref)
    ops.quant_decode(cpp[2], cpp[0], cpp[1], group, bits, out_cpp)
    # fp32 fma vs float64 reference: at most one rounding apart
    rtol = 2e-7 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out_cpp.float(), out_ref.float(), rtol=rtol, atol=1e-30)


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_quant_error_bound(bits):
    x = torch.randn(16, 100) * 3
    mins, scales, codes, status = _quant(ops.quant_encode, x, 25, bits)
    out = torch.empty_like(x)
    ops.quant_decode(codes, mins, scales, 25, bits, out)
    step = scales.view(16, 4).repeat_interleave(25, 1)
    assert status.item() == 0
    assert ((out - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()


@native
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,group", [((7, 33), 33), ((3, 50), 16), ((2, 256), 256)])
def test_fp8_cpp_equals_reference(fmt, dtype, shape, group):
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[1])).to(dtype)
    G = shape[0] * math.ceil(shape[1] / group)

    def run(enc, dec):
        s, c = torch.empty(G), torch.empty(shape[0] * shape[1], dtype=torch.uint8)
        st_ = torch.empty(1, dtype=torch.uint8)
        enc(x, group, fmt, s, c, st_)
        out = torch.empty(shape, dtype=dtype)
        dec(c, s, group, fmt, out)
        return s, c, st_, out

    ref, cpp = run(REF["fp8_encode"], REF["fp8_decode"]), run(ops.fp8_encode, ops.fp8_decode)
    for a, b in zip(ref, cpp):
        assert torch.equal(a, b)
    # half an fp8 ulp (relative, plus bf16 output rounding), or half the smallest subnormal times the scale
    rel, sub = {0: (2**-3, 2**-10), 1: (2**-2, 2**-17)}[fmt]
    xf, out = x.float(), cpp[3].float()
    floor = cpp[0].view(shape[0], -1).repeat_interleave(group, 1)[:, : shape[1]] * sub
    assert ((out - xf).abs() <= rel * xf.abs() + floor * 1.001).all()


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,L,k", [(3, 100, 7), (2, 1000, 300), (4, 17, 17), (1, 5, 1), (2, 70000, 700)])
def test_topk_cpp_equals_reference(dtype, B, L, k):
    x = torch.randn(B, L).to(dtype)
    x[:, ::7] = 0.5  # ties

    def run(fn):
        v, i = torch.empty(B, k, dtype=dtype), torch.empty(B, k, dtype=torch.int64)
        s = torch.empty(1, dtype=torch.uint8)
        fn(x, k, v, i, s)
        return v, i, s

    ref, cpp = run(REF["topk_encode"]), run(ops.topk_encode)
    for a, b in zip(ref, cpp):
        assert torch.equal(a, b)
    # the selection is the k largest |x|: every unselected |x| <= every selected one
    sel = torch.zeros(B, L, dtype=torch.bool).scatter_(1, cpp[1], True)
    a = x.float().abs()
    assert (a.masked_fill(sel, -1).amax(1) <= a.masked_fill(~sel, math.inf).amin(1)).all()
    o_ref, o_cpp = torch.empty(B, L, dtype=dtype), torch.empty(B, L, dtype=dtype)
    REF["topk_decode"](cpp[0], cpp[1], o_ref)
    ops.topk_decode(cpp[0], cpp[1], o_cpp)
    assert torch.equal(o_ref, o_cpp)


@native
@pytest.mark.parametrize("case", ["ties_at_threshold", "sorted", "reversed", "nan", "k_near_L", "constant"])
def test_topk_long_rows_equal_reference(case):
    """Rows long enough for the sampled selection (a bound from a sample, exact selection among the
    values that clear it, full histogram when too few do): equal to the reference on awkward data."""
    B, L = 2, 1 << 17
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, generator=g)
    k = L // 10
    if case == "ties_at_threshold":
        x = (x * 4).round() / 4  # few distinct values: the k-th is one of many equal ones
    elif case == "sorted":
        x = x.abs().sort(dim=1).values  # the sample sees small values first: its bound may be too high
    elif case == "reversed":
        x = x.abs().sort(dim=1, descending=True).values
    elif case == "nan":
        x[0, 12345] = float("nan")
        x[1, 777] = float("inf")
    elif case == "k_near_L":
        k = L - 3
    else:
        x = torch.full((B, L), 0.25)

    def run(fn):
        v, i = torch.empty(B, k), torch.empty(B, k, dtype=torch.int64)
        s = torch.empty(1, dtype=torch.uint8)
        fn(x, k, v, i, s)
        return v, i, s

    ref, cpp = run(REF["topk_encode"]), run(ops.topk_encode)
    assert torch.equal(ref[1], cpp[1]) and torch.equal(ref[2], cpp[2])
    assert torch.equal(ref[0].nan_to_num(), cpp[0].nan_to_num())


@native
@pytest.mark.parametrize("bits", [1, 3, 7, 8, 13, 17, 22, 23, 31, 32, 41, 56])
@pytest.mark.parametrize("n", [1, 8, 13, 1000, 8 * 4096 * 2 + 13])
def test_pack_bits_cpp_equals_reference(bits, n):
    idx = torch.randint(0, 1 << bits, (n,))
    a = torch.empty(ops.packed_nbytes(n, bits), dtype=torch.uint8)
    b = torch.empty_like(a)
    REF["pack_bits"](idx, bits, a)
    ops.pack_bits(idx, bits, b)
    assert torch.equal(a, b)
    u1, u2 = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    REF["unpack_bits"](a, bits, u1)
    ops.unpack_bits(a, bits, u2)
    assert torch.equal(u1, idx) and torch.equal(u2, idx)


def test_nonfinite_flagged():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 20)
        x[1, 5] = bad
        for fn in (REF["quant_encode"], ops.quant_encode):
            assert _quant(fn, x, 20, 4)[3].item() == 1
        v, i, s = torch.empty(3, 4), torch.empty(3, 4, dtype=torch.int64), torch.empty(1, dtype=torch.uint8)
        ops.topk_encode(x, 4, v, i, s)
        assert s.item() == 1
        sc, c, s = torch.empty(3), torch.empty(60, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        ops.fp8_encode(x, 20, 0, sc, c, s)
        assert s.item() == 1


@native
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [4096, 2048])
def test_quant_nonfinite_long_rows_equal_reference(bits, group):
    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(bits))
    x[1, 7], x[2, 3000], x[3, 100] = float("nan"), float("inf"), -float("inf")
    ref = _quant(REF["quant_encode"], x, group, bits)
    cpp = _quant(ops.quant_encode, x, group, bits)
    assert torch.equal(ref[0].nan_to_num(), cpp[0].nan_to_num())
    assert torch.equal(ref[1].nan_to_num(), cpp[1].nan_to_num())
    assert torch.equal(ref[2], cpp[2]) and torch.equal(ref[3], cpp[3])


@native
def test_cpp_input_errors():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="bits must be 2, 4, 6 or 8, got 3"):
        ops.quant_encode(x, 8, 3, *_quant_bufs(4, 8, 8, 4))
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.quant_encode(x.t(), 4, 8, *_quant_bufs(8, 4, 4, 8))
    with pytest.raises(RuntimeError, match=r"k must be in \[1, L=8\], got 9"):
        i = torch.empty(4, 9, dtype=torch.int64)
        ops.topk_encode(x, 9, torch.empty(4, 9), i, torch.empty(1, dtype=torch.uint8))


def test_opcheck_each_op():
    x = torch.randn(3, 20)
    torch.library.opcheck(ops.quant_encode, (x, 8, 6, *_quant_bufs(3, 20, 8, 6)))
    m, s, c, _ = _quant(ops.quant_encode, x, 8, 6)
    torch.library.opcheck(ops.quant_decode, (c, m, s, 8, 6, torch.empty(3, 20)))
    sc, cc, st_ = torch.empty(3), torch.empty(60, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
    torch.library.opcheck(ops.fp8_encode, (x, 20, 0, sc, cc, st_))
    torch.library.opcheck(ops.fp8_decode, (cc, sc, 20, 0, torch.empty(3, 20)))
    v, i = torch.empty(3, 5), torch.empty(3, 5, dtype=torch.int64)
    torch.library.opcheck(ops.topk_encode, (x, 5, v, i, torch.empty(1, dtype=torch.uint8)))
    ops.topk_encode(x, 5, v, i, torch.empty(1, dtype=torch.uint8))
    torch.library.opcheck(ops.topk_decode, (v, i, torch.empty(3, 20)))
    torch.library.opcheck(ops.pack_bits, (i.reshape(-1), 5, torch.empty(10, dtype=torch.uint8)))
    torch.library.opcheck(
        ops.unpack_bits,
        (torch.randint(0, 255, (10,), dtype=torch.uint8), 5, torch.empty(15, dtype=torch.int64)),
    )


@settings(max_examples=25, deadline=None)
@given(
    R=st.integers(1, 6),
    d=st.integers(1, 70),
    group=st.integers(1, 40),
    bits=st.sampled_from([2, 4, 6, 8]),
    scale=st.sampled_from([0.0, 1e-30, 1.0, 1e30, 3e38]),
    seed=st.integers(0, 2**16),
)
def test_quant_property(R, d, group, bits, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, d, generator=g).clamp(-1, 1) * scale
    ref = _quant(REF["quant_encode"], x, group, bits)
    cpp = _quant(ops.quant_encode, x, group, bits)
    for a, b in zip(ref, cpp):
        assert torch.equal(a, b)
    assert cpp[3].item() == 0  # huge but finite values are not flagged
    out = torch.empty_like(x)
    ops.quant_decode(cpp[2], cpp[0], cpp[1], group, bits, out)
    assert torch.isfinite(out).all()
    step = cpp[1].view(R, -1).repeat_interleave(group, 1)[:, :d]
    assert ((out - x).abs() <= step * 0.5001 + 1e-37 + x.abs() * 1e-6).all()
