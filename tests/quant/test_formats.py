"""Weight formats API (deepspeed_ppq.quant.formats): bitsandbytes parity, error bounds, buffers, errors."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ppq.config import WeightFormat
from deepspeed_ppq.quant import ops as wops
from deepspeed_ppq.quant.formats import DOUBLE_QUANT_GROUP, QuantizedWeight, quantize_weight

FORMATS = [f for f in WeightFormat if f is not WeightFormat.none]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import bitsandbytes.functional as bnbf


def test_nf4_codebook_is_bitsandbytes():
    assert torch.equal(torch.tensor(wops.NF4_CODE), bnbf.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 91), (64, 64), (1, 5), (1001,)])
@pytest.mark.parametrize("block_size", [32, 64, 256, 4096])
def test_nf4_codes_equal_bitsandbytes(dtype, shape, block_size):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.05).to(dtype)
    w.view(-1)[::11] = 0.0
    qw = quantize_weight(w, "nf4", block_size)
    packed, state = bnbf.quantize_4bit(w, blocksize=block_size, quant_type="nf4")
    assert packed.shape == (qw.qdata.numel(), 1)
    assert torch.equal(qw.qdata, packed.view(-1)), "NF4 codes differ from bitsandbytes"
    assert torch.equal(qw.scale, state.absmax), "NF4 absmax differs from bitsandbytes"


def _bound(fmt: str, x: torch.Tensor, s: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-value error bound from the block's stored scale s (expanded to x's length)."""
    n = x.numel()
    s = s.float().reshape(-1)
    s = s.expand(n) if s.numel() == 1 else s.repeat_interleave(block_size)[:n]
    q = wops.format_qmax(fmt)
    nb = wops.num_blocks(n, block_size)
    xb = torch.nn.functional.pad(x.abs(), (0, nb * block_size - n)).view(nb, block_size)
    absmax = xb.amax(1).repeat_interleave(block_size)[:n] if s.numel() == n else x.abs().max().expand(n)
    clip = (absmax - q * s).clamp(min=0)  # a scale that rounded down clips the largest values
    step = {"int8": 0.5 * s, "int4": 0.5 * s, "nf4": 0.1520 * s,  # half the widest NF4 gap (-0.6962 - -1)
            "fp8_e4m3": x.abs() * 2.0**-4 + s * 2.0**-10, "fp8_e5m2": x.abs() * 2.0**-3 + s * 2.0**-17}[fmt]
    return step + clip + 1e-6 * absmax + 1e-36


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from([f.value for f in FORMATS]),
    n=st.integers(1, 600),
    block_size=st.sampled_from([16, 64, 128, 4096]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale_dtype=st.sampled_from(["fp32", "bf16"]),
    double_quant=st.booleans(),
    per_tensor=st.booleans(),
    exp=st.integers(-30, 30),
    extremes=st.lists(st.tuples(st.integers(0, 599), st.sampled_from([0.0, 1e30, -1e30, 1e-30])), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip_within_bound(
    fmt, n, block_size, dtype, scale_dtype, double_quant, per_tensor, exp, extremes, seed
):
    fp8_scale = "tensor" if per_tensor and fmt.startswith("fp8") else "block"
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10.0**exp
    x[:: 5] = 0.0
    for i, v in extremes:
        x[i % n] = v
    x = x.to(dtype)
    qw = quantize_weight(x, fmt, block_size, scale_dtype, double_quant, fp8_scale)
    y = qw.dequantize(torch.float32)
    xf = x.float()
    err = (y - xf).abs()
    bound = _bound(fmt, xf, qw.block_scales(), block_size)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"{fmt}: |err|={err[worst]} > bound {bound[worst]} at x={xf[worst]}"
    assert bool((y[xf == 0] == 0).all()), "zeros must round-trip exactly"
    if dtype == torch.bfloat16:  # bf16 output is the fp32 result rounded once
        assert torch.equal(qw.dequantize(), y.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_round_trip_exactly(fmt):
    w = torch.zeros(3, 100)
    qw = quantize_weight(w, fmt, 64)
    assert torch.equal(qw.dequantize(), w) and torch.equal(qw.scale, torch.zeros_like(qw.scale))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale_dtype,double_quant", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_nbytes_and_storage_are_exact(fmt, scale_dtype, double_quant):
    w = torch.randn(300, 77)  # 23100 values: 361 blocks of 64 (last partial), 2 scale groups
    qw = quantize_weight(w, fmt, 64, scale_dtype, double_quant)
    code_bytes = {"int8": 23100, "int4": 11550, "nf4": 11550, "fp8_e4m3": 23100, "fp8_e5m2": 23100}[fmt.value]
    scale_bytes = 361 * (1 if double_quant else (4 if scale_dtype == "fp32" else 2))
    extra = 4 * math.ceil(361 / DOUBLE_QUANT_GROUP) if double_quant else 0
    assert qw.nbytes == code_bytes + scale_bytes + extra
    tensors = qw.storage_tensors()
    assert set(tensors) == ({"qdata", "scale", "scale_scale"} if double_quant else {"qdata", "scale"})
    assert sum(t.untyped_storage().nbytes() for t in tensors.values()) == qw.nbytes
    assert qw.fmt is fmt and qw.shape == w.shape


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_reused_buffer(fmt, out_dtype):
    w = torch.randn(65, 33, dtype=torch.bfloat16)
    qw = quantize_weight(w, fmt, 32, double_quant=True)
    out = torch.empty(65, 33, dtype=out_dtype)
    ptr = out.data_ptr()
    assert qw.dequantize(out=out) is out and out.data_ptr() == ptr
    assert torch.equal(out, qw.dequantize(out_dtype))
    assert qw.dequantize().dtype == torch.bfloat16  # default: the original dtype


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("double_quant", [False, True])
def test_requantize_reuses_buffers(fmt, double_quant):
    w1, w2 = torch.randn(40, 70), torch.randn(40, 70) * 3
    qw = quantize_weight(w1, fmt, 64, double_quant=double_quant)
    ptrs = {k: t.data_ptr() for k, t in qw.storage_tensors().items()}
    qw.requantize_(w2)
    assert {k: t.data_ptr() for k, t in qw.storage_tensors().items()} == ptrs
    fresh = quantize_weight(w2, fmt, 64, double_quant=double_quant)
    for k, t in fresh.storage_tensors().items():
        assert torch.equal(qw.storage_tensors()[k].view(torch.uint8), t.view(torch.uint8)), k


def test_double_quant_scales_never_clip():
    w = torch.randn(64, 1024) * torch.logspace(-3, 0, 64).unsqueeze(1)  # scales over three decades
    qw = quantize_weight(w, "int8", 64, double_quant=True)
    plain = quantize_weight(w, "int8", 64)
    assert qw.scale.dtype == torch.uint8 and qw.scale_scale.dtype == torch.float32
    assert bool((qw.block_scales() >= plain.scale * (1 - 1e-6)).all())
    assert qw.nbytes < plain.nbytes


def test_fp8_per_tensor_scale():
    w = torch.randn(50, 50)
    qw = QuantizedWeight.from_float(w, "fp8_e4m3", fp8_scale="tensor")
    assert qw.scale.shape == (1,) and qw.scale.item() == pytest.approx(w.abs().max().item() / 448.0)
    assert (qw.dequantize() - w).abs().max() <= w.abs().max() * 2.0**-4


def test_class_and_function_entry_points_agree():
    w = torch.randn(20, 30)
    a = QuantizedWeight.from_float(w, "nf4", block_size=32)
    b = QuantizedWeight.from_float(w, fmt=WeightFormat.nf4, block_size=32)
    c = quantize_weight(w, WeightFormat.nf4, 32)
    assert a.fmt is b.fmt is c.fmt is WeightFormat.nf4
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.qdata, c.qdata)


def test_nonfinite_weights_raise_with_count():
    w = torch.randn(8, 100)
    w[1, 3] = float("nan")
    w[5, 7] = float("inf")
    w[6, 0] = float("-inf")
    for dq in (False, True):
        with pytest.raises(ValueError, match=r"shape \(8, 100\) to nf4: 3 NaN/Inf value\(s\) of 800"):
            quantize_weight(w, "nf4", 64, double_quant=dq)
    qw = quantize_weight(torch.randn(8, 100), "int8")
    with pytest.raises(ValueError, match=r"to int8: 3 NaN/Inf"):
        qw.requantize_(w)


def test_bad_arguments_are_named():
    w = torch.randn(10, 10)
    with pytest.raises(ValueError, match="fmt='none' is not a low-bit weight format"):
        quantize_weight(w, "none")
    with pytest.raises(ValueError, match="fmt='int3' is not a low-bit weight format: use one of int8"):
        quantize_weight(w, "int3")
    with pytest.raises(ValueError, match="block_size=8 is not allowed"):
        quantize_weight(w, "int8", 8)
    with pytest.raises(ValueError, match="scale_dtype='fp16' is not allowed"):
        quantize_weight(w, "int8", scale_dtype="fp16")
    with pytest.raises(ValueError, match="fp8_scale='tensor' is only for fp8 formats"):
        quantize_weight(w, "int4", fp8_scale="tensor")
    with pytest.raises(ValueError, match="fmt='int3' is not a low-bit weight format"):
        QuantizedWeight.from_float(w, "int3")
    with pytest.raises(ValueError, match="w has dtype torch.float16"):
        quantize_weight(w.half(), "int8")
    qw = quantize_weight(w, "int8")
    with pytest.raises(ValueError, match=r"requantize_ needs a tensor of shape \(10, 10\), got \(10, 11\)"):
        qw.requantize_(torch.randn(10, 11))
    with pytest.raises(ValueError, match=r"out has shape \(100,\), expected \(10, 10\)"):
        qw.dequantize(out=torch.empty(100))


def test_given_scales_must_be_finite_and_non_negative():
    x = torch.randn(128)
    for bad in (-1.0, float("nan"), float("inf")):
        codes = torch.full((128,), 5, dtype=torch.int8)
        scales = torch.tensor([0.1, bad])
        msg = rf"scales\[1\]={bad} is not allowed \(1 of 2 bad\): scales must be finite and >= 0"
        with pytest.raises(ValueError, match=msg):
            wops.weight_quantize_codes_out(x, scales, "int8", 64, codes)
        assert bool((codes == 5).all()), "codes were written before the scales were checked"
    # 0 is an all-zero block's scale: allowed (zero codes), with and without double quantization
    codes = torch.empty(128, dtype=torch.int8)
    wops.weight_quantize_codes_out(torch.zeros(128), torch.zeros(2), "int8", 64, codes)
    assert not codes.any()
    w = torch.randn(4, 64)
    w[1] = 0.0
    assert torch.equal(quantize_weight(w, "nf4", 64, double_quant=True).dequantize()[1], w[1])


def test_bf16_scale_overflow_is_not_reported_as_nonfinite_input():
    w = torch.full((64,), 3.4e38)  # finite; nf4's scale is absmax / 1, above bfloat16's largest value
    with pytest.raises(ValueError, match=r"to nf4: a block's scale \(absmax / 1\) overflows the scale dtype "
                                         r"torch.bfloat16, whose largest absmax is about 3.39e\+38"):
        quantize_weight(w, "nf4", scale_dtype="bf16")
    assert torch.equal(quantize_weight(w, "nf4").dequantize(), w)  # fp32 scales hold it
    w[3] = float("nan")
    with pytest.raises(ValueError, match=r"to nf4: 1 NaN/Inf value\(s\) of 64"):
        quantize_weight(w, "nf4", scale_dtype="bf16")


def test_sr_quantize_checks_arguments_before_allocating():
    from deepspeed_ppq.quant.sr_ops import weight_quantize_sr

    with pytest.raises(ValueError, match="block_size=0 is not allowed: use a power of two in"):
        weight_quantize_sr(torch.randn(64), "int8", block_size=0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        weight_quantize_sr([1.0] * 64, "int8")
    with pytest.raises(ValueError, match="scale_dtype=torch.float16 is not allowed"):
        weight_quantize_sr(torch.randn(64), "int8", scale_dtype=torch.float16)


def test_storage_bytes_check_arguments_like_quantize_weight():
    from deepspeed_ppq.quant.formats import weight_storage_bytes

    for bs in (0, 3, 8192):
        with pytest.raises(ValueError, match=f"block_size={bs} is not allowed: use a power of two"):
            weight_storage_bytes((64, 64), "int8", block_size=bs)
    with pytest.raises(ValueError, match="fp8_scale='bogus' is not allowed: use 'block' or 'tensor'"):
        weight_storage_bytes((64, 64), "fp8_e4m3", fp8_scale="bogus")
    with pytest.raises(ValueError, match="scale_dtype='fp16' is not allowed"):
        weight_storage_bytes((64, 64), "int8", scale_dtype="fp16", double_quant=True)
    with pytest.raises(ValueError, match="fmt='int3' is not a low-bit weight format"):
        weight_storage_bytes((64, 64), "int3")
    for shape in ((-64,), (4, -1), (2.5,)):
        with pytest.raises(ValueError, match=r"shape=.* is not allowed: use a sequence of ints >= 0"):
            weight_storage_bytes(shape, "int8")
    # the ledger passes one fp8_scale for every format: "tensor" counts block scales for int8
    block = weight_storage_bytes((64, 64), "int8")
    assert weight_storage_bytes((64, 64), "int8", fp8_scale="tensor") == block
