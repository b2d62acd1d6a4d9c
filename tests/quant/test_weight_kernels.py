"""The C++ weight kernels (csrc/cpu/weights.cpp) against the plain-PyTorch references, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ppq import ops as registry
from deepspeed_ppq.quant import ops as wops

pytestmark = pytest.mark.skipif(
    registry.native_status().get("_C") != "loaded",
    reason=f"C++ extension not loaded ({registry.native_status().get('_C')}); run `make build`",
)

FORMATS = wops.WEIGHT_FORMATS
REF = registry.registered_ops()
OPS = ["weight_quantize_out", "weight_quantize_codes_out", "weight_dequantize_out", "weight_quantize",
       "weight_dequantize"]


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).exp()
    x.view(-1)[:: 7] = 0.0
    return x.to(dtype)


def _buffers(fmt, n, block_size, scale_dtype, per_tensor=False):
    codes = torch.empty(wops.codes_numel(fmt, n), dtype=wops.code_dtype(fmt))
    scales = torch.empty(1 if per_tensor else wops.num_blocks(n, block_size), dtype=scale_dtype)
    return codes, scales


def _codes_bits(c):
    return c.view(torch.uint8) if c.dtype.itemsize == 1 else c


def _assert_same_quantize(x, fmt, block_size, scale_dtype, per_tensor=False):
    n = x.numel()
    c_cpp, s_cpp = _buffers(fmt, n, block_size, scale_dtype, per_tensor)
    c_ref, s_ref = _buffers(fmt, n, block_size, scale_dtype, per_tensor)
    torch.ops.ppq.weight_quantize_out(x, fmt, block_size, c_cpp, s_cpp)
    REF["weight_quantize_out"](x, fmt, block_size, c_ref, s_ref)
    assert torch.equal(s_cpp, s_ref), f"scales differ for {fmt} {x.dtype} {tuple(x.shape)} B={block_size}"
    diff = (_codes_bits(c_cpp) != _codes_bits(c_ref)).nonzero()
    where = f"({fmt}, {x.dtype}, B={block_size}), first at {diff[:5].flatten().tolist()}"
    assert diff.numel() == 0, f"{diff.numel()} codes differ {where}"
    return c_cpp, s_cpp


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block_size", [((37, 91), 64), ((257, 129), 16), ((5, 1001), 4096), ((3,), 16)]
)
def test_codes_and_values_match_reference(fmt, dtype, scale_dtype, shape, block_size):
    x = _sample(shape, dtype)
    codes, scales = _assert_same_quantize(x, fmt, block_size, scale_dtype)
    for out_dtype in (torch.float32, torch.bfloat16):
        out_cpp = torch.full(shape, float("nan"), dtype=out_dtype)
        out_ref = torch.empty(shape, dtype=out_dtype)
        torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block_size, out_cpp)
        REF["weight_dequantize_out"](codes, scales, fmt, block_size, out_ref)
        assert torch.equal(out_cpp, out_ref), f"dequantize differs ({fmt}, out {out_dtype})"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_per_tensor_scale_matches_reference(fmt, dtype):
    x = _sample((300, 70), dtype, seed=3)
    codes, scales = _assert_same_quantize(x, fmt, 64, torch.float32, per_tensor=True)
    assert scales.numel() == 1 and torch.equal(scales[0], x.float().abs().max() / wops.format_qmax(fmt))
    out = torch.empty(x.shape)
    torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, 64, out)
    assert torch.equal(out, REF["weight_dequantize"](codes, scales, fmt, 64, list(x.shape), torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_from_given_scales_match_reference(fmt):
    x = _sample((129, 33), torch.float32, seed=5)
    scales = torch.rand(wops.num_blocks(x.numel(), 32)) + 0.01
    scales[3] = 0.0
    c_cpp = _buffers(fmt, x.numel(), 32, torch.float32)[0]
    c_ref = torch.empty_like(c_cpp)
    torch.ops.ppq.weight_quantize_codes_out(x, scales, fmt, 32, c_cpp)
    REF["weight_quantize_codes_out"](x, scales, fmt, 32, c_ref)
    assert torch.equal(_codes_bits(c_cpp), _codes_bits(c_ref))


_extreme = st.sampled_from([0.0, -0.0, 1e-45, -3e-39, 1e-30, 65504.0, -1e30, 3.0e38, -3.0e38, 0.5, -0.5])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 700),
    fmt=st.sampled_from(FORMATS),
    block_size=st.sampled_from([16, 32, 64, 256]),
    bf16=st.booleans(),
    bf16_scale=st.booleans(),
    scale_exp=st.integers(-40, 37),
    extremes=st.lists(st.tuples(st.integers(0, 699), _extreme), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_property_codes_match_reference(n, fmt, block_size, bf16, bf16_scale, scale_exp, extremes, seed):
    """Random sizes (partial last block), magnitudes from 1e-40 to 1e37, zeros and extreme values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * (10.0**scale_exp)
    for i, v in extremes:
        x[i % n] = v
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    if not torch.isfinite(x).all():  # e.g. 3e38 rounded to bf16 inf: the non-finite path is tested apart
        return
    codes, scales = _assert_same_quantize(x, fmt, block_size, torch.bfloat16 if bf16_scale else torch.float32)
    for out_dtype in (torch.float32, torch.bfloat16):
        a = torch.empty(n, dtype=out_dtype)
        torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block_size, a)
        b = REF["weight_dequantize"](codes, scales, fmt, block_size, [n], out_dtype)
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_conversions_match_torch_on_every_code_and_tie(fmt):
    """Every fp8 value, every midpoint between neighbours (round-half-even ties) and nudges around them."""
    dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    allv = torch.arange(256, dtype=torch.uint8).view(dt).float()
    vals = allv[torch.isfinite(allv)].unique()
    mids = (vals[:-1] + vals[1:]) / 2
    up, down = mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-1e38))
    x = torch.cat([vals, mids, up, down])
    scale = torch.ones(1)  # per-tensor scale 1: the encode is the bare conversion (after clamping)
    codes = torch.empty(x.numel(), dtype=dt)
    torch.ops.ppq.weight_quantize_codes_out(x, scale, fmt, 4096, codes)
    assert torch.equal(codes.view(torch.uint8), x.to(dt).view(torch.uint8))
    every = torch.arange(256, dtype=torch.uint8).view(dt)
    out = torch.empty(256)
    torch.ops.ppq.weight_dequantize_out(every, scale, fmt, 4096, out)
    torch.testing.assert_close(out, every.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_every_code_to_bf16_matches_reference(fmt, scale_dtype):
    """Every code, a full block of 256 each (the vector paths), dequantized to bf16 under scales that are
    ordinary, negative, zero, non-finite, subnormal, huge, either side of the edges of the fp8 table
    path (s in [2^-120, 2^119) for e4m3, [2^-112, 2^112) for e5m2), and 48 drawn log-uniformly."""
    dt = wops.code_dtype(fmt)
    every = torch.arange(256, dtype=torch.uint8).view(dt)
    below = 1 - 2.0**-24
    edges = [2.0**-120, 2.0**-120 * below, 2.0**-112, 2.0**-112 * below, 2.0**119, 2.0**119 * below,
             2.0**112, 2.0**112 * below]
    drawn = torch.exp2(torch.empty(48).uniform_(-135, 128, generator=torch.Generator().manual_seed(0)))
    scales = torch.cat([torch.tensor([1.0, 0.37, -0.37, 0.0, float("nan"), float("inf"), 3e-39, 1e-30, 2.0**8,
                                      1e30, 3e38, *edges]), drawn])
    scales = scales.to(scale_dtype)
    codes = every.repeat(scales.numel())
    a, b = (torch.empty(codes.numel(), dtype=torch.bfloat16) for _ in range(2))
    torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, 256, a)
    REF["weight_dequantize_out"](codes, scales, fmt, 256, b)
    nan = b.isnan()  # a NaN's bits are not part of the contract (torch's own casts differ in them)
    assert torch.equal(a.isnan(), nan), f"{fmt}: NaNs differ"
    assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16)), f"{fmt}: bf16 values differ"


def test_nf4_midpoints_and_bin_edges_match_reference():
    """The AVX-512 NF4 encode looks codes up by 1/16-wide bins: every midpoint, every bin edge, and the
    floats either side of each, in a full 4096-value block (the vector path), against the reference."""
    code = torch.tensor(wops.NF4_CODE, dtype=torch.float32)
    mids = (code[:-1] + code[1:]) / 2
    edges = torch.arange(-16, 17, dtype=torch.float32) / 16
    pts = torch.cat([mids, edges])
    up, down = pts.nextafter(torch.tensor(2.0)), pts.nextafter(torch.tensor(-2.0))
    x = torch.cat([pts, up, down, torch.tensor([1.5, -3.0])])
    x = torch.cat([x, torch.zeros(4096 - x.numel())])
    scale = torch.ones(1)
    codes, ref = (torch.empty(2048, dtype=torch.uint8) for _ in range(2))
    torch.ops.ppq.weight_quantize_codes_out(x, scale, "nf4", 4096, codes)
    REF["weight_quantize_codes_out"](x, scale, "nf4", 4096, ref)
    assert torch.equal(codes, ref)


def _blocks_with_anchor(vals: torch.Tensor, anchor: float, block: int = 64) -> torch.Tensor:
    """vals in blocks of ``block`` - 1, each block led by ``anchor`` (its absmax, so its scale)."""
    n = -(-vals.numel() // (block - 1)) * (block - 1)
    body = torch.cat([vals, torch.zeros(n - vals.numel(), dtype=vals.dtype)]).view(-1, block - 1)
    return torch.cat([torch.full((body.shape[0], 1), anchor, dtype=vals.dtype), body], dim=1).flatten()


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_unclamped_runs_match_reference_at_every_edge(fmt, scale_dtype):
    """Runs of finite blocks with normal scales skip the clamp on AVX-512: int4 rounds x / s, which stays
    within 7 (1 + 2^-8) with a bf16 scale rounded down, and NF4 takes its bin from the truncation of
    16 y + 15.5. At every rounding tie or bin edge, every midpoint and the floats either side, with
    anchors that make y = x (s = 1) or push |y| to its largest (an fp32 absmax the bf16 scale rounds
    down by almost 2^-8); and every bf16 value within the range, as bf16 input."""
    q = 7.0 if fmt == "int4" else 1.0
    if fmt == "int4":
        pts = torch.arange(-7.5, 7.6, 0.5)
    else:
        code = torch.tensor(wops.NF4_CODE, dtype=torch.float32)
        edges = torch.arange(-16, 17) / 16
        pts = torch.cat([(code[:-1] + code[1:]) / 2, edges + 1 / 32, edges])
    pts = torch.cat([pts, pts.nextafter(torch.tensor(1e9)), pts.nextafter(torch.tensor(-1e9))]).clamp(-q, q)
    for anchor in (q, -q, q * (1 + 2**-8 - 2**-20), -q * (1 + 2**-8 - 2**-20)):
        _assert_same_quantize(_blocks_with_anchor(pts, anchor), fmt, 64, scale_dtype)
    # bf16 input: every bf16 value of magnitude <= q, scale q (bf16 input's absmax is its own bf16 scale)
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = bits[bits.float().abs() <= q]
    vals = torch.cat([vals, -vals])
    _assert_same_quantize(_blocks_with_anchor(vals, q).to(torch.bfloat16), fmt, 64, scale_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-38, 1e-37, 3e-36, 1e-30, 1e30, 1e37])
def test_tiny_and_huge_blocks_match_reference(fmt, dtype, magnitude):
    """Whole tensors of tiny or huge values (scales near the float range's ends): e.g. NF4's 16 / s
    overflows for s < 1e-36, and the vector path must then scale in two steps."""
    x = _sample((4096,), torch.float32) * magnitude
    _assert_same_quantize(x.to(dtype), fmt, 64, torch.float32)


def test_int_rounding_ties_are_half_even():
    s = torch.ones(1)
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -127.5, 200.0] + [0.0] * 7)
    codes = torch.empty(16, dtype=torch.int8)
    torch.ops.ppq.weight_quantize_codes_out(x, s, "int8", 16, codes)
    assert codes[:9].tolist() == [0, 2, 2, 0, -2, 126, 127, -127, 127]


def test_nonfinite_block_gets_nan_scale():
    x = torch.randn(200)
    x[70] = float("inf")
    x[150] = float("nan")
    codes, scales = _buffers("int8", 200, 64, torch.float32)
    torch.ops.ppq.weight_quantize_out(x, "int8", 64, codes, scales)
    assert torch.isnan(scales).tolist() == [False, True, True, False]


def _opcheck_inputs(fmt):
    x = _sample((40, 50), torch.float32, seed=1)
    codes, scales = _buffers(fmt, x.numel(), 64, torch.float32)
    REF["weight_quantize_out"](x, fmt, 64, codes, scales)
    return {
        "weight_quantize_out": (x, fmt, 64, codes.clone(), scales.clone()),
        "weight_quantize_codes_out": (x, scales, fmt, 64, codes.clone()),
        "weight_dequantize_out": (codes, scales, fmt, 64, torch.empty(40, 50, dtype=torch.bfloat16)),
        "weight_quantize": (x.bfloat16(), fmt, 64, torch.bfloat16, False),
        "weight_dequantize": (codes, scales, fmt, 64, [40, 50], torch.float32),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(fmt, op):
    assert registry.has_kernel(op, "cpu"), f"no C++ CPU kernel registered for ppq::{op}"
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if fmt.startswith("fp8") and op != "weight_quantize":
        # test_schema compares fp8 tensor arguments before/after with a multiply that torch lacks for
        # float8 on CPU ("mul_cpu_reduced_float" not implemented); the other three checks still run.
        utils = utils[1:]
    torch.library.opcheck(getattr(torch.ops.ppq, op), _opcheck_inputs(fmt)[op], test_utils=utils)


def test_cpp_checks_name_the_problem():
    x = torch.randn(100)
    codes, scales = _buffers("int8", 100, 64, torch.float32)
    with pytest.raises(RuntimeError, match="block_size=48 is not allowed"):
        torch.ops.ppq.weight_quantize_out(x, "int8", 48, codes, scales)
    with pytest.raises(RuntimeError, match="x has dtype Half"):
        torch.ops.ppq.weight_quantize_out(x.half(), "int8", 64, codes, scales)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        torch.ops.ppq.weight_quantize_out(torch.randn(10, 10).t(), "int8", 64, codes, scales)
    with pytest.raises(RuntimeError, match="codes has 99 elements; 100 values need 100"):
        torch.ops.ppq.weight_quantize_out(x, "int8", 64, codes[:99], scales)
    with pytest.raises(RuntimeError, match="scales has 1 elements; 100 values in blocks of 64 need 2"):
        torch.ops.ppq.weight_quantize_out(x, "int8", 64, codes, scales[:1])
    with pytest.raises(RuntimeError, match="fmt='int3' is not a weight format"):
        torch.ops.ppq.weight_quantize_out(x, "int3", 64, codes, scales)
    with pytest.raises(RuntimeError, match="scales has dtype BFloat16; allowed: Float$"):
        torch.ops.ppq.weight_quantize_codes_out(x, scales.bfloat16(), "int8", 64, codes)


def test_python_checks_name_the_problem():
    x = torch.randn(100)
    codes, scales = _buffers("nf4", 100, 64, torch.float32)
    with pytest.raises(ValueError, match="block_size=100 is not allowed"):
        wops.weight_quantize_out(x, "nf4", 100, codes, scales)
    with pytest.raises(ValueError, match="codes for nf4 must be a contiguous torch.uint8 tensor of 50"):
        wops.weight_quantize_out(x, "nf4", 64, codes[:10], scales)
    with pytest.raises(ValueError, match="per_tensor=True is only for fp8"):
        wops.weight_quantize(x, "int4", 64, per_tensor=True)
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        wops.weight_quantize(torch.arange(10), "int8")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_cuda_kernels_match_cpu(fmt, dtype, per_tensor):
    """csrc/cuda/weights.cu gives the CPU kernel's codes, scales and values bit for bit."""
    if per_tensor and not fmt.startswith("fp8"):
        pytest.skip("per-tensor scales are for fp8 formats only")
    assert registry.has_kernel("weight_quantize_out", "cuda"), registry.native_status()
    x = _sample((513, 77), dtype, seed=11)
    for block_size, scale_dtype in ((64, torch.float32), (16, torch.bfloat16), (4096, torch.float32)):
        c, s = _buffers(fmt, x.numel(), block_size, scale_dtype, per_tensor)
        torch.ops.ppq.weight_quantize_out(x, fmt, block_size, c, s)
        cg, sg = c.cuda(), s.cuda()
        torch.ops.ppq.weight_quantize_out(x.cuda(), fmt, block_size, cg, sg)
        assert torch.equal(sg.cpu(), s) and torch.equal(_codes_bits(cg.cpu()), _codes_bits(c))
        for out_dtype in (torch.float32, torch.bfloat16):
            o = torch.empty(x.shape, dtype=out_dtype)
            torch.ops.ppq.weight_dequantize_out(c, s, fmt, block_size, o)
            og = torch.empty(x.shape, dtype=out_dtype, device="cuda")
            torch.ops.ppq.weight_dequantize_out(cg, sg, fmt, block_size, og)
            assert torch.equal(og.cpu(), o)
        cg2 = torch.empty_like(cg)
        torch.ops.ppq.weight_quantize_codes_out(x.cuda(), s.float().cuda(), fmt, block_size, cg2)
        c2 = torch.empty_like(c)
        torch.ops.ppq.weight_quantize_codes_out(x, s.float(), fmt, block_size, c2)
        assert torch.equal(_codes_bits(cg2.cpu()), _codes_bits(c2))
