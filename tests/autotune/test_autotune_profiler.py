"""The profiler on a tiny GPT: formats follow the policy, bytes match the ledger, cache keys."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from deepspeed_ppq.autotune.memory import StageMemTracker
from deepspeed_ppq.autotune.planner import PlanningProblem, plan_pipeline
from deepspeed_ppq.autotune.profiler import (
    layers_from_cache,
    load_cached,
    merge_parts,
    profile_codecs,
    profile_key,
    profile_layers,
    save_cache,
)
from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss, layer_kinds

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=3)


def _batch(b):
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g)
    return ids, ids


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    layers = gpt_layers(CFG)
    wcfg = WeightsConfig(keep_first_blocks=1, keep_last_blocks=0)
    prof = profile_layers(
        layers, layer_kinds(CFG), _batch, gpt_loss, wcfg, ("int8", "nf4"), (1, 2), reps=2, warmup=1
    )
    return layers, prof


def test_formats_follow_the_policy(profile):
    layers, prof = profile
    kinds = [p.kind for p in prof]
    assert kinds == layer_kinds(CFG)
    # embedding and head stay dense (sensitive names), block 0 is kept by keep_first_blocks=1
    assert prof[0].allowed_formats == ["none"] and prof[-1].allowed_formats == ["none"]
    assert prof[1].allowed_formats == ["none"]
    assert prof[2].allowed_formats == ["none", "int8", "nf4"]
    d, ff = CFG.d_model, CFG.d_ff
    assert prof[2].quantizable_params == 3 * d * d + d * d + 2 * d * ff  # qkv, proj, fc, mlp.proj weights
    assert 0 < prof[2].quant_error["int8"] < prof[2].quant_error["nf4"] < 0.2


def test_bytes_and_times(profile):
    layers, prof = profile
    blk = prof[2]
    dense = sum(p.numel() * 4 for p in layers[2].parameters())
    assert blk.weight_bytes["none"] == dense
    assert blk.weight_bytes["int8"] < dense / 2 and blk.weight_bytes["nf4"] < blk.weight_bytes["int8"]
    assert blk.input_bytes == blk.output_bytes == CFG.seq_len * CFG.d_model * 4
    assert prof[0].input_bytes == CFG.seq_len * 8  # int64 token ids
    assert blk.saved_bytes["none"] > blk.input_bytes  # attention and MLP intermediates
    for p in prof:
        for fmt in p.allowed_formats:
            assert set(p.times[fmt]) == {1, 2} and all(t >= 0 for v in p.times[fmt].values() for t in v)
    assert prof[0].times["none"][1][1] == 0.0  # token ids have no input gradient


@pytest.mark.parametrize("count", [2, 3])
def test_shares_measured_apart_merge_into_the_whole_profile(profile, count):
    """The tuner's ranks each profile a share of the (layer, micro-batch size) pairs; merged, the shares
    hold what one run over all of them holds: every field but the timings equal (peaks too: the same
    tracker), the times of every format at every size."""
    layers, whole = profile
    wcfg = WeightsConfig(keep_first_blocks=1, keep_last_blocks=0)
    parts = [profile_layers(layers, layer_kinds(CFG), _batch, gpt_loss, wcfg, ("int8", "nf4"), (1, 2), reps=2,
                            warmup=1, share=(r, count)) for r in range(count)]
    for r, part in enumerate(parts):  # layer i at the s-th size in share (i + s) % count only
        for i, lp in enumerate(part):
            assert set(lp.times.get("none", {})) == {b for s, b in enumerate((1, 2)) if (i + s) % count == r}
    merged = merge_parts(parts)
    for m, w in zip(merged, whole, strict=True):
        assert {f: set(v) for f, v in m.times.items()} == {f: set(v) for f, v in w.times.items()}
        assert m.peak_bytes == w.peak_bytes
        for field in ("name", "kind", "param_numels", "quantizable_params", "allowed_formats", "weight_bytes",
                      "saved_bytes", "input_bytes", "output_bytes", "quant_error", "workspace_bytes"):
            assert getattr(m, field) == getattr(w, field), field
    assert parts[0][2].times["int8"].keys() == {1 if count == 2 else 2}  # the parts were not changed
    with pytest.raises(ValueError, match="a profile part has 2 layers, the first 5"):
        merge_parts([parts[0], parts[1][:2]])
    first_missing = 0 if count == 2 else 1  # the first layer the last share alone measured at size 2
    with pytest.raises(ValueError, match=rf"layer {first_missing} was measured in no profile part at "
                                         r"micro-batch size\(s\) \[2\]"):
        merge_parts(parts[:-1])
    with pytest.raises(ValueError, match=r"share \(2, 2\): want \(index, count\)"):
        profile_layers(layers, layer_kinds(CFG), _batch, gpt_loss, wcfg, ("int8",), (1,), share=(2, 2))


def test_tracker_sees_what_the_profile_predicts(profile):
    """After a block's forward, the tracker's live activations are the profiled saved bytes, the
    output and at most the input (tracked as the caller's); its forward+backward peak is the profile's
    ``peak_bytes`` (the same tracker measured it)."""
    layers, prof = profile
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    g = torch.randn(2, CFG.seq_len, CFG.d_model)
    tracker = StageMemTracker()
    tracker.track_external(layers[2], x, g)
    with tracker:
        y = layers[2](x)
        live = tracker.current()["activations"]
        y.backward(g)
        del y
    saved = prof[2].saved_bytes["none"] * 2
    out_bytes = x.nbytes  # a block keeps the shape
    assert saved + out_bytes <= live <= saved + out_bytes + x.nbytes
    peak = tracker.peak()
    assert peak["activations"] + peak["temporaries"] == pytest.approx(prof[2].peak_bytes["none"][2], rel=0.05)
    assert prof[2].peak_bytes["none"][2] > saved  # backward needs more than it saved
    layers[2].zero_grad(set_to_none=True)


def test_cache_roundtrip_and_mismatch(profile, tmp_path):
    layers, prof = profile
    codecs = profile_codecs(
        [{"method": "none"}, {"method": "quant", "bits": 8}], (2, CFG.seq_len, CFG.d_model)
    )
    from deepspeed_ppq.compress import payload_nbytes
    from deepspeed_ppq.config import CodecConfig

    shape = (2, CFG.seq_len, CFG.d_model)
    raw = 4 * shape[0] * shape[1] * shape[2]
    expect = payload_nbytes(CodecConfig(method="quant", bits=8), shape, torch.float32) / raw
    assert codecs[1].wire_ratio == expect < 0.5 and codecs[1].encode_s_per_byte > 0
    key = profile_key(layers, mbs=[1, 2])
    path = tmp_path / "p.json"
    save_cache(path, key, prof, codecs, {"optimizer_costs": {"adam": 1e-9}})
    data = load_cached(path, key)
    back, back_codecs = layers_from_cache(json.loads(json.dumps(data)))
    assert [b.to_dict() for b in back] == [p.to_dict() for p in prof] and back_codecs == codecs
    other = profile_key(
        gpt_layers(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)), mbs=[1, 2]
    )
    assert other != key and profile_key(layers, mbs=[1, 4]) != key
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert load_cached(path, other) is None
    assert any("measured for another model" in str(x.message) for x in w)
    # a measured profile plans
    plan = plan_pipeline(PlanningProblem(layers=back, world_size=2, global_batch=4, micro_batch_sizes=[1, 2]))
    assert plan.boundaries[0] == 0 and plan.boundaries[-1] == len(back)


@pytest.mark.parametrize("case", ["train", "master_free", "frozen_by_model"])
def test_tracker_counts_low_bit_storage_as_the_ledger_does(case):
    """Codes, scales, the dequantization buffer, and a master-free weight's gradient buffer and AdamW
    states live outside the parameters: the tracker counts them, in the categories the planner predicts,
    as ``measure_storage`` does (a block trained one step first, so every buffer exists)."""
    from deepspeed_ppq.quant import (
        attach_master_free,
        build_optimizer,
        clear_workspace,
        convert_model,
        measure_storage,
    )

    torch.manual_seed(0)
    block = torch.nn.Sequential(gpt_layers(CFG)[1])
    if case == "frozen_by_model":
        block.requires_grad_(False)
        block[0].ln1.requires_grad_(True)  # something to train
    wcfg = WeightsConfig(format="int8", keep_first_blocks=0, keep_last_blocks=0,
                         master="none" if case == "master_free" else "fp32")
    convert_model(block, wcfg, block_layers=[0], num_blocks=1)
    opt = build_optimizer([p for p in block.parameters() if p.requires_grad], "adam", lr=1e-3)
    if case == "master_free":
        attach_master_free(opt, block)
    clear_workspace()
    x = torch.randn(2, CFG.seq_len, CFG.d_model)
    block(x).square().mean().backward()
    opt.step()
    led = measure_storage(block, opt).groups()
    tracker = StageMemTracker()
    tracker.track_external(block, opt)
    with tracker:
        now = tracker.current()
    assert now["parameters"] == led.get("weights", 0) + led.get("master_weights", 0) + led.get("workspace", 0)
    assert now["gradients"] == led.get("gradients", 0)
    assert now["optimizer"] == led.get("optimizer", 0)
    if case != "train":
        assert "master_weights" not in led
