"""CUDA kernels (csrc/cuda) against their plain-PyTorch references and the C++ CPU kernels, on a GPU.

Every test is marked ``gpu``: without a CUDA GPU and a CUDA build of PyTorch it is skipped
(tests/conftest.py). On a GPU machine a missing CUDA kernel is a failure, not a skip. What must hold:
  * integer codes, packed bytes and TopK indices equal the reference's (and so the CPU kernel's) bit for
    bit, for fp32, bf16 and fp16 inputs, odd shapes, and groups that do or do not start on whole bytes;
  * decoded values equal the CPU kernel's bit for bit (both compute in fp32 the way compress/ops.py says),
    and the reference's to its documented bound (it decodes in float64);
  * the 8-bit Adam step equals the CPU kernel's and the reference's parameters, absmax and codes bit for bit;
  * NaN/Inf set the status byte; TopK's values-only gradient path decodes with the activation's indices;
  * ``torch.library.opcheck`` passes on each op with CUDA tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

import deepspeed_ppq.quant.adam8bit  # noqa: F401  (declares ppq::adam8bit_blockwise_step_)
from deepspeed_ppq.compress import codecs, ops
from deepspeed_ppq.config import CodecConfig
from deepspeed_ppq.ops import has_kernel, native_status, registered_ops

pytestmark = pytest.mark.gpu
REF = registered_ops()
CUDA_OPS = ("quant_encode", "quant_decode", "fp8_encode", "fp8_decode", "topk_encode", "topk_decode",
            "pack_bits", "unpack_bits", "adam8bit_blockwise_step_")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def _cuda_kernels_loaded():
    missing = [n for n in CUDA_OPS if not has_kernel(n, "cuda")]
    assert not missing, f"no CUDA kernel registered for {missing}: extensions {native_status()}"


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality on the CPU, NaN equal to NaN (payloads may differ between recipes)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all()) and a.shape == b.shape
    return torch.equal(a, b)


def _nonfinite(x: torch.Tensor, case: str) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    if case == "nan":
        flat[flat.numel() // 2] = float("nan")
    elif case == "inf":
        flat[0] = float("inf")
        flat[-1] = -float("inf")
    return x


# ---- k-bit min-max ---------------------------------------------------------------------------------------
QUANT_SHAPES = [((7, 33), 33), ((4, 64), 16), ((3, 50), 16), ((2, 4096), 4096), ((5, 9), 4), ((1, 1), 1),
                ((3, 5000), 5000), ((9, 77), 1000), ((6, 40), 8)]


def _quant_bufs(R, d, group, bits, device):
    G = R * math.ceil(d / group)
    return (torch.empty(G, device=device), torch.empty(G, device=device),
            torch.empty(ops.packed_nbytes(R * d, bits), dtype=torch.uint8, device=device),
            torch.empty(1, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("shape,group", QUANT_SHAPES)
@pytest.mark.parametrize("case", ["finite", "nan", "inf"])
def test_quant_equals_reference(dtype, bits, shape, group, case):
    g = torch.Generator().manual_seed(bits * 100 + shape[1])
    x = _nonfinite((torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[1])).to(dtype), case)
    ref = _quant_bufs(*shape, group, bits, "cpu")
    REF["quant_encode"](x, group, bits, *ref)
    gpu = _quant_bufs(*shape, group, bits, "cuda")
    ops.quant_encode(x.cuda(), group, bits, *gpu)
    for name, a, b in zip(("mins", "scales", "codes", "status"), ref, gpu):
        assert _equal(a, b), name
    assert int(gpu[3].item()) == int(case != "finite")
    gpu_out = torch.empty(shape, dtype=dtype, device="cuda")
    ops.quant_decode(gpu[2], gpu[0], gpu[1], group, bits, gpu_out)
    if has_kernel("quant_decode", "cpu"):  # the C++ CPU kernel decodes in fp32 as well: the same bits
        cpu_out = torch.empty(shape, dtype=dtype)
        ops.quant_decode(ref[2], ref[0], ref[1], group, bits, cpu_out)
        assert _equal(cpu_out, gpu_out)
    if case == "finite":  # fp32 fma vs the float64 reference: one rounding apart (plus the output dtype's)
        ref_out = torch.empty(shape, dtype=dtype)
        REF["quant_decode"](ref[2], ref[0], ref[1], group, bits, ref_out)
        rtol = {torch.float32: 2e-7, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(gpu_out.cpu().float(), ref_out.float(), rtol=rtol, atol=1e-30)


def test_quant_huge_values_are_not_flagged():
    x = (torch.rand(5, 70, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 3e38
    for bits, group in ((8, 70), (6, 13), (2, 8)):
        ref = _quant_bufs(5, 70, group, bits, "cpu")
        REF["quant_encode"](x, group, bits, *ref)
        gpu = _quant_bufs(5, 70, group, bits, "cuda")
        ops.quant_encode(x.cuda(), group, bits, *gpu)
        assert all(_equal(a, b) for a, b in zip(ref, gpu)) and int(gpu[3].item()) == 0


# ---- FP8 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("shape,group", [((7, 33), 33), ((3, 50), 16), ((2, 256), 256), ((4, 300), 300),
                                         ((2, 5000), 5000), ((9, 77), 1000), ((1, 1), 1)])
@pytest.mark.parametrize("case", ["finite", "nan", "inf", "zero_row"])
def test_fp8_equals_reference(dtype, fmt, shape, group, case):
    g = torch.Generator().manual_seed(fmt * 10 + shape[1])
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])).to(dtype)
    if case == "zero_row":
        x[0] = 0
    else:
        x = _nonfinite(x, case)
    G = shape[0] * math.ceil(shape[1] / group)

    def run(enc, dec, xd):
        dev = xd.device
        s, c = torch.empty(G, device=dev), torch.empty(xd.numel(), dtype=torch.uint8, device=dev)
        st = torch.empty(1, dtype=torch.uint8, device=dev)
        enc(xd, group, fmt, s, c, st)
        out = torch.empty(shape, dtype=dtype, device=dev)
        dec(c, s, group, fmt, out)
        return s, c, st, out

    ref = run(REF["fp8_encode"], REF["fp8_decode"], x)
    gpu = run(ops.fp8_encode, ops.fp8_decode, x.cuda())
    for name, a, b in zip(("scales", "codes", "status", "decoded"), ref, gpu):
        if name == "codes":  # a NaN code's sign is the hardware's (see _nan_codes_as_one)
            a, b = _nan_codes_as_one(a, fmt), _nan_codes_as_one(b, fmt)
        assert _equal(a, b), name
    assert int(gpu[2].item()) == int(case in ("nan", "inf"))


def _nan_codes_as_one(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    """FP8 codes with every NaN code as 0x7f. A group holding an Inf has scale Inf and 1 / scale = 0, so its
    Inf codes as Inf * 0 = NaN, whose sign is the hardware's default NaN: negative on x86 (the reference and
    the CPU kernel give 0xff), positive on a GPU (0x7f). Both decode to NaN and set the status byte."""
    codes = codes.cpu()
    return codes.masked_fill(codes.view(ops.FP8_FORMATS[fmt][0]).float().isnan(), 0x7F)


# ---- TopK ------------------------------------------------------------------------------------------------
def _topk(fn, x, k):
    B, dev = x.shape[0], x.device
    v = torch.empty(B, k, dtype=x.dtype, device=dev)
    i = torch.empty(B, k, dtype=torch.int64, device=dev)
    s = torch.empty(1, dtype=torch.uint8, device=dev)
    fn(x, k, v, i, s)
    return v, i, s


def _check_topk(x, k):
    ref, gpu = _topk(REF["topk_encode"], x, k), _topk(ops.topk_encode, x.cuda(), k)
    assert torch.equal(ref[1], gpu[1].cpu()), "indices"
    assert _equal(ref[0], gpu[0]) and torch.equal(ref[2], gpu[2].cpu()), "values / status"
    out_ref = torch.empty(x.shape, dtype=x.dtype)
    REF["topk_decode"](ref[0], ref[1], out_ref)
    out_gpu = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    ops.topk_decode(gpu[0], gpu[1], out_gpu)
    assert _equal(out_ref, out_gpu), "decoded"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,k", [(3, 100, 7), (2, 1000, 300), (4, 17, 17), (1, 5, 1), (2, 5000, 4096),
                                   (64, 777, 13)])
def test_topk_short_rows_equal_reference(dtype, B, L, k):
    x = torch.randn(B, L, generator=torch.Generator().manual_seed(L)).to(dtype)
    x[:, ::7] = 0.5  # ties
    _check_topk(x, k)


@pytest.mark.parametrize("case", ["plain", "ties_at_threshold", "sorted", "reversed", "nan", "k_near_L",
                                  "constant", "small_k", "half_k", "zeros_and_outliers", "bf16", "f16",
                                  "odd_length"])
def test_topk_long_rows_equal_reference(case):
    """Rows long enough for the multi-block path (sample bound, ordered candidate compaction with look-back,
    radix digits over the candidates), including data that sends a row to the one-block path."""
    B, L = 3, 1 << 18
    if case == "odd_length":
        L += 4093
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, generator=g)
    k = L // 10
    if case == "ties_at_threshold":
        x = (x * 4).round() / 4
    elif case == "sorted":
        x = x.abs().sort(dim=1).values
    elif case == "reversed":
        x = x.abs().sort(dim=1, descending=True).values
    elif case == "nan":
        x[0, 12345] = float("nan")
        x[1, 777] = float("inf")
        x[2, L - 1] = -float("inf")
    elif case == "k_near_L":
        k = L - 3
    elif case == "constant":
        x = torch.full((B, L), 0.25)
    elif case == "small_k":
        k = 5
    elif case == "half_k":
        k = L // 2
    elif case == "zeros_and_outliers":
        x = torch.where(torch.rand(B, L, generator=g) < 0.95, 0.0, x)
        x[:, 1000:1010] = 1e6
    elif case == "bf16":
        x = x.bfloat16()
    elif case == "f16":
        x = x.half()
    _check_topk(x, k)


def test_topk_gradient_reuses_the_activations_indices():
    """The values-only TopK path: the gradient is gathered at the activation's indices and decoded with them,
    on the GPU, giving the CPU's payload bytes and output."""
    cfg = CodecConfig(method="topk", topk_ratio=0.05)
    shape = (3, 4, 50000)
    g = torch.Generator().manual_seed(7)
    act, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    def run(device):
        a, gr = act.to(device), grad.to(device)
        lay = codecs.payload_layout(cfg, shape, a.dtype)
        p = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
        idx = codecs.encode_into(cfg, a, p, lay)
        lay_g = codecs.payload_layout(cfg, shape, gr.dtype, values_only=True)
        pg = torch.empty(lay_g.nbytes, dtype=torch.uint8, device=device)
        codecs.encode_into(cfg, gr, pg, lay_g, indices=idx)
        out_a, out_g = torch.empty_like(a), torch.empty_like(gr)
        idx_rx = codecs.decode_from(cfg, p, lay, out_a)
        codecs.decode_from(cfg, pg, lay_g, out_g, indices=idx_rx)
        return p.cpu(), pg.cpu(), out_a.cpu(), out_g.cpu(), idx.cpu(), idx_rx.cpu()

    cpu, gpu = run("cpu"), run("cuda")
    names = ("payload", "grad payload", "activation", "gradient", "indices", "rx indices")
    for name, a, b in zip(names, cpu, gpu):
        assert torch.equal(a, b), name
    kept = gpu[5]
    assert torch.equal(gpu[3].view(3, -1).gather(1, kept), grad.view(3, -1).gather(1, kept))


def test_topk_decode_rejects_indices_out_of_range():
    v = torch.randn(2, 4, device="cuda")
    i = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 50]], device="cuda")
    with pytest.raises(RuntimeError, match=r"indices must lie in \[0, L=50\); 1 do not"):
        ops.topk_decode(v, i, torch.empty(2, 50, device="cuda"))


# ---- bit packing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 3, 7, 8, 13, 17, 22, 31, 41, 56])
@pytest.mark.parametrize("n", [1, 8, 13, 1000, 2048, 2049, 100_003])
def test_pack_bits_equal_reference(bits, n):
    idx = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits + n))
    idx[::5] = -idx[::5] - 1  # taken mod 2^bits
    a = torch.empty(ops.packed_nbytes(n, bits), dtype=torch.uint8)
    REF["pack_bits"](idx, bits, a)
    b = torch.empty(a.numel(), dtype=torch.uint8, device="cuda")
    ops.pack_bits(idx.cuda(), bits, b)
    assert torch.equal(a, b.cpu())
    u_ref, u = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64, device="cuda")
    REF["unpack_bits"](a, bits, u_ref)
    ops.unpack_bits(b, bits, u)
    assert torch.equal(u_ref, u.cpu())


# ---- 8-bit Adam ------------------------------------------------------------------------------------------
def _adam_state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // 256)
    return [torch.randn(n, generator=g) * 0.02, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), torch.rand(nb, generator=g) * 1e-3,
            torch.rand(nb, generator=g) * 1e-6]


def _maps():
    F = pytest.importorskip("bitsandbytes").functional
    dense = torch.cat([torch.linspace(-1, -0.1, 100), torch.linspace(-0.099, 0.0999, 56),
                       torch.linspace(0.1, 1, 100)])
    return [(F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)), (dense, (dense + 1) / 2)]


@pytest.mark.parametrize("n", [5, 256, 1000, 4096 + 77, 1 << 20])
@pytest.mark.parametrize("weight_decay,step,gnorm_scale", [(0.0, 1, 1.0), (0.01, 7, 1.0), (0.1, 1000, 0.5)])
def test_adam8bit_equals_cpu_kernel(n, weight_decay, step, gnorm_scale):
    """Bit for bit with the C++ CPU kernel (same fp32 operations in the same order), with bitsandbytes' maps
    and a map the CPU kernel bisects; an all-zero block keeps the codes of 0."""
    for q1, q2 in _maps():
        grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
        grad[::97] = 0.0
        cpu, gpu = _adam_state(n), [t.cuda() for t in _adam_state(n)]
        if n > 512:
            grad[:256] = 0.0
            for s in (cpu, gpu):
                s[3][0] = s[4][0] = 0.0
        args = (0.9, 0.999, 1e-8, step, 1e-3, weight_decay, gnorm_scale)
        torch.ops.ppq.adam8bit_blockwise_step_(cpu[0], grad, cpu[1], cpu[2], cpu[3], cpu[4], q1, q2, *args)
        torch.ops.ppq.adam8bit_blockwise_step_(gpu[0], grad.cuda(), gpu[1], gpu[2], gpu[3], gpu[4], q1.cuda(),
                                               q2.cuda(), *args)
        for name, a, b in zip(("p", "state1", "state2", "absmax1", "absmax2"), cpu, gpu):
            assert torch.equal(a, b.cpu()), name


def test_adam8bit_nonfinite_gradient_stays_in_its_block():
    """A NaN/Inf gradient poisons its own values only: the absmax skips a NaN as the CPU kernel does, and
    every parameter, absmax and code (a NaN moment's too) equals the CPU kernel's, but for the codes of the
    Inf gradient's moments: Inf * (1 / absmax Inf) is a NaN whose sign is the hardware's default NaN
    (negative on x86, positive on a GPU), so those two codes are 0 on the CPU and 255 on the GPU."""
    q1, q2 = _maps()[0]
    n = 3 * 256
    grad = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    grad[300], grad[10] = float("nan"), float("inf")
    cpu, gpu = _adam_state(n), [t.cuda() for t in _adam_state(n)]
    args = (0.9, 0.999, 1e-8, 3, 1e-3, 0.0, 1.0)
    torch.ops.ppq.adam8bit_blockwise_step_(cpu[0], grad, cpu[1], cpu[2], cpu[3], cpu[4], q1, q2, *args)
    torch.ops.ppq.adam8bit_blockwise_step_(gpu[0], grad.cuda(), gpu[1], gpu[2], gpu[3], gpu[4], q1.cuda(),
                                           q2.cuda(), *args)
    assert _equal(cpu[0], gpu[0]) and torch.equal(cpu[3], gpu[3].cpu()) and torch.equal(cpu[4], gpu[4].cpu())
    made_nan = torch.isinf(grad)
    for a, b in ((cpu[1], gpu[1]), (cpu[2], gpu[2])):
        assert torch.equal(a[~made_nan], b.cpu()[~made_nan])
    assert bool(torch.isfinite(gpu[0][512:]).all())  # the third block saw no NaN


def test_adam8bit_equals_reference_over_steps():
    """Three steps from zero states against the plain-PyTorch reference run on the GPU: bit for bit (the
    reference's square root is taken in float64, so it is correctly rounded like the kernel's)."""
    q1, q2 = (q.cuda() for q in _maps()[0])
    n = 50_000
    g = torch.Generator().manual_seed(4)
    zero = int((q1 == 0).nonzero()[0])
    nb = -(-n // 256)
    a = [(torch.randn(n, generator=g) * 0.02).cuda(),
         torch.full((n,), zero, dtype=torch.uint8, device="cuda"),
         torch.zeros(n, dtype=torch.uint8, device="cuda"), torch.zeros(nb, device="cuda"),
         torch.zeros(nb, device="cuda")]
    b = [t.clone() for t in a]
    for step in (1, 2, 3):
        grad = (torch.randn(n, generator=g) * 1e-3).cuda()
        args = (q1, q2, 0.9, 0.999, 1e-8, step, 1e-3, 0.01, 1.0)
        torch.ops.ppq.adam8bit_blockwise_step_(a[0], grad, a[1], a[2], a[3], a[4], *args)
        REF["adam8bit_blockwise_step_"](b[0], grad, b[1], b[2], b[3], b[4], *args)
        for name, x, y in zip(("p", "state1", "state2", "absmax1", "absmax2"), a, b):
            assert torch.equal(x, y), f"step {step}: {name} differs from the reference"


# ---- input checks and opcheck ----------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 8, device="cuda")
    bufs = _quant_bufs(4, 8, 8, 4, "cuda")
    with pytest.raises(RuntimeError, match="bits must be 2, 4, 6 or 8, got 3"):
        ops.quant_encode(x, 8, 3, *bufs)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.quant_encode(x.t(), 4, 8, *_quant_bufs(8, 4, 4, 8, "cuda"))
    with pytest.raises(RuntimeError, match="mins must be a CUDA tensor"):
        ops.quant_encode(x, 8, 4, bufs[0].cpu(), *bufs[1:])
    with pytest.raises(RuntimeError, match="x has dtype Double; allowed: Float"):
        ops.fp8_encode(x.double(), 8, 0, torch.empty(4, device="cuda"),
                       torch.empty(32, dtype=torch.uint8, device="cuda"), bufs[3])
    with pytest.raises(RuntimeError, match=r"k must be in \[1, L=8\], got 9"):
        ops.topk_encode(x, 9, torch.empty(4, 9, device="cuda"),
                        torch.empty(4, 9, dtype=torch.int64, device="cuda"), bufs[3])
    with pytest.raises(RuntimeError, match="bits must be in \\[1, 56\\], got 57"):
        ops.pack_bits(torch.zeros(3, dtype=torch.int64, device="cuda"), 57,
                      torch.empty(22, dtype=torch.uint8, device="cuda"))
    with pytest.raises(RuntimeError, match="out has 20 elements; needs 21"):  # 3 x 56 bits = 21 bytes
        ops.pack_bits(torch.zeros(3, dtype=torch.int64, device="cuda"), 56,
                      torch.empty(20, dtype=torch.uint8, device="cuda"))
    s = [t.cuda() for t in _adam_state(300)]
    with pytest.raises(RuntimeError, match="absmax1 has 1 elements; needs 2"):
        qmap = torch.zeros(256, device="cuda")
        torch.ops.ppq.adam8bit_blockwise_step_(s[0], s[0].clone(), s[1], s[2], s[3][:1], s[4], qmap, qmap,
                                               0.9, 0.999, 1e-8, 1, 1e-3, 0.0, 1.0)


def test_opcheck_each_op():
    dev = "cuda"
    x = torch.randn(3, 20, device=dev)
    st = torch.empty(1, dtype=torch.uint8, device=dev)
    torch.library.opcheck(ops.quant_encode, (x, 8, 6, *_quant_bufs(3, 20, 8, 6, dev)))
    m, s, c, _ = _quant_bufs(3, 20, 8, 6, dev)
    ops.quant_encode(x, 8, 6, m, s, c, st)
    torch.library.opcheck(ops.quant_decode, (c, m, s, 8, 6, torch.empty(3, 20, device=dev)))
    sc, cc = torch.empty(3, device=dev), torch.empty(60, dtype=torch.uint8, device=dev)
    torch.library.opcheck(ops.fp8_encode, (x, 20, 0, sc, cc, st))
    torch.library.opcheck(ops.fp8_decode, (cc, sc, 20, 0, torch.empty(3, 20, device=dev)))
    v, i = torch.empty(3, 5, device=dev), torch.empty(3, 5, dtype=torch.int64, device=dev)
    torch.library.opcheck(ops.topk_encode, (x, 5, v, i, st))
    ops.topk_encode(x, 5, v, i, st)
    torch.library.opcheck(ops.topk_decode, (v, i, torch.empty(3, 20, device=dev)))
    torch.library.opcheck(ops.pack_bits, (i.reshape(-1), 5, torch.empty(10, dtype=torch.uint8, device=dev)))
    torch.library.opcheck(ops.unpack_bits, (torch.randint(0, 255, (10,), dtype=torch.uint8, device=dev), 5,
                                            torch.empty(15, dtype=torch.int64, device=dev)))
    q1, q2 = _maps()[0]
    a = [t.cuda() for t in _adam_state(1000)]
    args = (a[0], torch.randn(1000, device=dev) * 1e-3, a[1], a[2], a[3], a[4], q1.cuda(), q2.cuda(), 0.9,
            0.999, 1e-8, 2, 1e-3, 0.0, 1.0)
    torch.library.opcheck(torch.ops.ppq.adam8bit_blockwise_step_.default, args,
                          test_utils=("test_schema", "test_faketensor"))
