"""The fused 8-bit Adam step (csrc/cpu/adam8bit.cpp) against its reference and against bitsandbytes."""

import pytest
import torch

from deepspeed_ppq import ops as registry
from deepspeed_ppq.quant.adam8bit import BNB_BLOCK_SIZE as BLOCK
from deepspeed_ppq.quant.adam8bit import adam8bit_step, optimizer_class
from deepspeed_ppq.quant.optim import build_optimizer

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional
native = pytest.mark.skipif(
    registry.native_status().get("_C") != "loaded",
    reason=f"C++ extension not loaded ({registry.native_status().get('_C')}); run `make build`",
)
REF = registry.registered_ops()["adam8bit_blockwise_step_"]
Q1, Q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // BLOCK)
    return [
        torch.randn(n, generator=g) * 0.02,
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
        torch.rand(nb, generator=g) * 1e-3,
        torch.rand(nb, generator=g) * 1e-6,
    ]


def _assert_equal_states(a, b):
    for name, x, y in zip(("p", "state1", "state2", "absmax1", "absmax2"), a, b, strict=True):
        assert torch.equal(x, y), f"{name}: {int((x != y).sum())} of {x.numel()} values differ"


@native
@pytest.mark.parametrize("n", [5, 256, 1000, 4096 + 77, 1 << 18])
@pytest.mark.parametrize("weight_decay,step,gnorm_scale", [(0.0, 1, 1.0), (0.01, 7, 1.0), (0.1, 1000, 0.5)])
def test_cpp_matches_reference(n, weight_decay, step, gnorm_scale):
    """Bit for bit, over three consecutive steps (each re-encodes what the previous one wrote)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    g[::97] = 0.0
    a, b = _state(n), _state(n)
    for t in range(step, step + 3):
        args = (Q1, Q2, 0.9, 0.999, 1e-8, t, 1e-3, weight_decay, gnorm_scale)
        torch.ops.ppq.adam8bit_blockwise_step_(a[0], g, a[1], a[2], a[3], a[4], *args)
        REF(b[0], g, b[1], b[2], b[3], b[4], *args)
        _assert_equal_states(a, b)


@native
def test_cpp_matches_reference_at_the_code_midpoints():
    """New states exactly on a midpoint between two codes (the tie goes to the lower code) and one ulp
    to either side. With beta1 = beta2 = 0 the step writes m = g and v = g * g, and each block's first
    gradient is 1, so m / absmax = g exactly: g runs over qmap1's midpoints (exact ties for state1)
    and the square roots of qmap2's (v within an ulp or two of its midpoints)."""
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    mids1, mids2 = (Q1[:-1] + Q1[1:]) / 2, ((Q2[:-1] + Q2[1:]) / 2).sqrt()
    y = torch.cat([m for x in (mids1, mids2) for m in (x, torch.nextafter(x, up), torch.nextafter(x, down))])
    y = y[y.abs() < 1]
    nb = -(-y.numel() // (BLOCK - 1))
    rest = torch.zeros(nb * (BLOCK - 1))
    rest[: y.numel()] = y
    g = torch.cat([torch.ones(nb, 1), rest.view(nb, BLOCK - 1)], dim=1).view(-1)  # 1: each block's absmax
    a, b = _state(g.numel()), _state(g.numel())
    args = (Q1, Q2, 0.0, 0.0, 1e-8, 1, 1e-3, 0.0, 1.0)
    torch.ops.ppq.adam8bit_blockwise_step_(a[0], g, a[1], a[2], a[3], a[4], *args)
    REF(b[0], g, b[1], b[2], b[3], b[4], *args)
    _assert_equal_states(a, b)
    ties = torch.isin(g, mids1)
    assert int(ties.sum()) > 200
    lower = torch.bucketize(g[ties], mids1)  # the lower code of each tie
    assert torch.equal(a[1][ties].long(), lower)


@native
def test_all_zero_block_and_a_map_that_needs_bisection():
    """An all-zero block keeps the codes of 0; a map with two midpoints in one 2^-7 cell (not
    bitsandbytes') takes the bisection path, with the same codes as the reference."""
    n = 3 * BLOCK
    g = torch.randn(n) * 1e-3
    g[:BLOCK] = 0.0
    dense = torch.cat([torch.linspace(-1, -0.1, 100), torch.linspace(-0.099, 0.0999, 56),
                       torch.linspace(0.1, 1, 100)])
    for q1, q2 in ((Q1, Q2), (dense, (dense + 1) / 2)):
        a, b = _state(n), _state(n)
        for s in (a, b):  # block 0: zero states and gradient
            s[1][:BLOCK] = int((q1 == 0).nonzero()[0]) if bool((q1 == 0).any()) else int(q1.abs().argmin())
            s[2][:BLOCK] = int(q2.abs().argmin())
            s[3][0] = s[4][0] = 0.0
        args = (q1, q2, 0.9, 0.999, 1e-8, 3, 1e-3, 0.0, 1.0)
        torch.ops.ppq.adam8bit_blockwise_step_(a[0], g, a[1], a[2], a[3], a[4], *args)
        REF(b[0], g, b[1], b[2], b[3], b[4], *args)
        _assert_equal_states(a, b)
        assert a[3][0] == 0 and a[4][0] == 0


@native
def test_agrees_with_bitsandbytes_kernel():
    """Same algorithm as bitsandbytes' optimizer_update_8bit_blockwise: parameters to 1e-5 of a step,
    codes equal or neighbours (its bisecting quantizer and float order can land one code off)."""
    n = 50_000
    g = torch.randn(n) * 1e-3
    a, c = _state(n), _state(n)
    adam8bit_step(a[0], g, a[1], a[2], a[3], a[4], Q1, Q2, beta1=0.9, beta2=0.999, eps=1e-8, step=4, lr=1e-3,
                  weight_decay=0.01)
    F.optimizer_update_8bit_blockwise("adam", g, c[0], c[1], c[2], 0.9, 0.999, 0.0, 0.0, 1e-8, 4, 1e-3,
                                      Q1, Q2, c[3], c[4], 0.01, 1.0)
    torch.testing.assert_close(a[0], c[0], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(a[3], c[3], rtol=1e-6, atol=0)
    torch.testing.assert_close(a[4], c[4], rtol=1e-6, atol=0)
    for k, q, amax in ((1, Q1, a[3]), (2, Q2, a[4])):
        assert (a[k] != c[k]).float().mean().item() < 0.05
        # at most one step of the map (its widest is 0.014, next to +-1) times the block absmax apart
        gap = (q[a[k].long()] - q[c[k].long()]).abs() * amax.repeat_interleave(BLOCK)[:n]
        assert bool((gap <= 0.015 * amax.repeat_interleave(BLOCK)[:n]).all())


def test_optimizer_trains_like_bitsandbytes_and_shares_its_state_dict():
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 8)

    def run(cls):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
        losses = []
        for _ in range(30):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return model, opt, losses

    ours_cls = optimizer_class("adamw8bit")
    assert build_optimizer([torch.nn.Parameter(torch.zeros(4))], "adamw8bit").__class__ is ours_cls
    _, opt, ours = run(ours_cls)
    _, _, theirs = run(bnb.optim.AdamW8bit)
    assert ours[-1] < 0.5 * ours[0]
    assert abs(ours[-1] - theirs[-1]) <= 0.02 * theirs[-1]
    other = bnb.optim.AdamW8bit(run(ours_cls)[0].parameters(), lr=1e-2)
    other.load_state_dict(opt.state_dict())  # same layout both ways
    st = next(iter(other.state.values()))
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].dtype == torch.float32


def test_bad_input_names_the_field():
    a = _state(300)
    with pytest.raises(ValueError, match="state2 is a torch.float32 tensor"):
        adam8bit_step(a[0], torch.zeros(300), a[1], a[2].float(), a[3], a[4], Q1, Q2, beta1=0.9, beta2=0.999,
                      eps=1e-8, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="absmax1 .* needs a contiguous torch.float32 tensor of 2 values"):
        adam8bit_step(a[0], torch.zeros(300), a[1], a[2], a[3][:1], a[4], Q1, Q2, beta1=0.9, beta2=0.999,
                      eps=1e-8, step=1, lr=1e-3)
    kw = dict(beta2=0.999, eps=1e-8, lr=1e-3)
    with pytest.raises(ValueError, match="step=0"):
        adam8bit_step(*a[:1], torch.zeros(300), *a[1:], Q1, Q2, beta1=0.9, step=0, **kw)
    with pytest.raises(ValueError, match="step=True"):
        adam8bit_step(*a[:1], torch.zeros(300), *a[1:], Q1, Q2, beta1=0.9, step=True, **kw)
    with pytest.raises(ValueError, match=r"beta1=1.0 is not allowed: use a finite number in \[0, 1\)"):
        adam8bit_step(*a[:1], torch.zeros(300), *a[1:], Q1, Q2, beta1=1.0, step=1, **kw)
    with pytest.raises(ValueError, match="not an 8-bit Adam"):
        optimizer_class("adam")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"lr": float("nan")}, "lr=nan is not allowed: use a finite number >= 0"),
        ({"lr": float("inf")}, "lr=inf is not allowed"),
        ({"lr": -1e-3}, "lr=-0.001 is not allowed"),
        ({"eps": float("nan")}, "eps=nan is not allowed"),
        ({"weight_decay": float("nan")}, "weight_decay=nan is not allowed"),
        ({"beta2": float("nan")}, r"beta2=nan is not allowed: use a finite number in \[0, 1\)"),
        ({"gnorm_scale": float("nan")}, "gnorm_scale=nan is not allowed: use a finite number > 0"),
        ({"gnorm_scale": 0.0}, "gnorm_scale=0.0 is not allowed"),
        ({"gnorm_scale": -1.0}, "gnorm_scale=-1.0 is not allowed"),
    ],
)
def test_bad_hyper_parameter_is_named_and_nothing_changes(kw, match):
    a = _state(300)
    before = [t.clone() for t in a]
    hyper = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 1, "lr": 1e-3, **kw}
    with pytest.raises(ValueError, match=match):
        adam8bit_step(a[0], torch.randn(300), *a[1:], Q1, Q2, **hyper)
    _assert_equal_states(a, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_parameters_take_bitsandbytes_step(dtype):
    """The fused op is fp32; a bf16/fp16 parameter steps as bitsandbytes' own AdamW8bit steps it."""
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(64, 128, dtype=dtype))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opts = [build_optimizer([ours], "adamw8bit", lr=1e-2, weight_decay=0.1),
            bnb.optim.AdamW8bit([theirs], lr=1e-2, weight_decay=0.1)]
    for _ in range(2):
        ours.grad = torch.randn_like(ours)
        theirs.grad = ours.grad.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(ours, theirs) and opts[0].state[ours]["step"] == 2


def test_a_refused_step_is_not_counted():
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    opt = build_optimizer([p], "adamw8bit", lr=1e-2)
    opt.step()
    opt.state[p]["absmax1"] = torch.zeros(1)  # as a checkpoint of another parameter's layout
    with pytest.raises(ValueError, match="absmax1 is a torch.float32 tensor of 1 values"):
        opt.step()
    assert opt.state[p]["step"] == 1


@native
def test_opcheck():
    a = _state(1000)
    g = torch.randn(1000) * 1e-3
    args = (a[0], g, a[1], a[2], a[3], a[4], Q1, Q2, 0.9, 0.999, 1e-8, 2, 1e-3, 0.0, 1.0)
    torch.library.opcheck(torch.ops.ppq.adam8bit_blockwise_step_.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@native
@pytest.mark.parametrize("n", [BLOCK, 3 * BLOCK + 77])
def test_non_finite_moments_code_as_the_reference(n):
    """NaN and Inf moments: a gradient NaN in some lanes, +-Inf in others, and one that overflows g * g
    (a finite gradient, an infinite second moment); then a finite step on what that wrote (a NaN or Inf
    absmax, Inf * (1 / Inf) = NaN codes). The absmax is NaN where a moment is (the reference's amax), a
    NaN of either sign takes the last code (its bucketize), all bit for bit."""
    gens = [lambda g: g.__setitem__(slice(3, None, 50), float("nan")),
            lambda g: g.__setitem__(slice(5, None, 70), float("inf")),
            lambda g: g.__setitem__(slice(7, None, 90), -float("inf")),
            lambda g: g.__setitem__(slice(None, None, 40), 1e20)]
    for poison in gens:
        a, b = _state(n), _state(n)
        for t, bad in ((1, True), (2, False)):
            g = torch.randn(n, generator=torch.Generator().manual_seed(t)) * 1e-3
            if bad:
                poison(g)
            args = (Q1, Q2, 0.9, 0.999, 1e-8, t, 1e-3, 0.0, 1.0)
            torch.ops.ppq.adam8bit_blockwise_step_(a[0], g, a[1], a[2], a[3], a[4], *args)
            REF(b[0], g, b[1], b[2], b[3], b[4], *args)
            for name, x, y in zip(("p", "state1", "state2", "absmax1", "absmax2"), a, b, strict=True):
                same = (x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y
                assert bool(same.all()), f"step {t}: {name}: {int((~same).sum())} of {x.numel()} differ"
        assert not all(bool(s.isfinite().all()) for s in (a[3], a[4]))  # the poison reached an absmax


@native
def test_a_map_evicted_from_the_kernels_cache_mid_step():
    """The kernel caches the last 8 code maps; the step's second map may evict its first (here Q1,
    the oldest after 3 other pairs): the step still codes with Q1, as the reference."""
    def maps(k):
        a, b = Q1.clone(), Q2.clone()
        a[1] += k * 1e-7
        b[1] += k * 1e-7
        return a, b

    n = 2 * BLOCK
    g = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3
    for q1, q2 in [(Q1, Q2), maps(1), maps(2), maps(3), (Q1, maps(99)[1])]:
        a, b = _state(n), _state(n)
        args = (q1, q2, 0.9, 0.999, 1e-8, 3, 1e-3, 0.0, 1.0)
        torch.ops.ppq.adam8bit_blockwise_step_(a[0], g, a[1], a[2], a[3], a[4], *args)
        REF(b[0], g, b[1], b[2], b[3], b[4], *args)
        _assert_equal_states(a, b)
