"""The planner's DP against brute force, the baseline comparison, infeasible budgets, plan JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from itertools import combinations, product
from types import SimpleNamespace

import pytest

from deepspeed_ppq.autotune.costs import CodecOption, LayerProfile, optimizer_bytes
from deepspeed_ppq.autotune.memory import MIB
from deepspeed_ppq.autotune.plan import PLAN_SCHEMA_VERSION, Plan, PlanError, load_plan
from deepspeed_ppq.autotune.planner import (
    InfeasibleBudgetError,
    Knobs,
    PlanningProblem,
    StageChoice,
    best_stock,
    evaluate_stages,
    plan_pipeline,
    solve_partition,
    stage_levels,
)
from deepspeed_ppq.schedule import LinkModel

FORMATS = {"none": 1.0, "int8": 0.25, "nf4": 0.14}

def baseline_plan(prob, method: str = "parameters", optimizer_8bit: bool = False):
    """The fastest stock configuration with DeepSpeed's ``method`` partition at the largest degree."""
    from deepspeed_ppq.integrations.model_layers import deepspeed_partitions

    p = max(prob.degrees())
    cuts = deepspeed_partitions([layer.params for layer in prob.layers], p)[method]
    return best_stock(prob, {p: {method: cuts}}, optimizer_8bit)



def _layer(rng: random.Random, name: str, kind: str, params: int, flops: float) -> LayerProfile:
    allowed = ["none"] if kind != "block" else ["none", "int8", "nf4"]
    times = {}
    for f in allowed:
        slow = 1.0 + rng.uniform(0.0, 0.3) * (f != "none")  # dequantization overhead
        times[f] = {mb: [flops * mb * slow, flops * mb * slow, flops * mb * slow * 0.9] for mb in (1, 2, 4)}
    return LayerProfile(
        name=name,
        kind=kind,
        param_numels=[params, 64],
        quantizable_params=params if kind == "block" else 0,
        allowed_formats=allowed,
        times=times,
        weight_bytes={f: int(4 * params * FORMATS[f]) + 256 for f in allowed},
        # the embedding saves its token ids only (and is never recomputed)
        saved_bytes={f: int(rng.uniform(2, 6) * 4096) if kind != "embed" else 512 for f in allowed},
        input_bytes=4096,
        output_bytes=4096,
        # the largest low-bit weight's dequantization buffer: a stage holds the largest of its layers'
        workspace_bytes={f: 2 * params for f in allowed if f != "none"},
    )


def _problem(seed: int, n_layers: int, heavy_ends: bool = False, **kw) -> PlanningProblem:
    rng = random.Random(seed)
    layers = []
    for i in range(n_layers):
        kind = "embed" if i == 0 else "head" if i == n_layers - 1 else "block"
        if heavy_ends and kind != "block":
            params, flops = 40_000, 1.2e-2  # vocab-sized: few FLOPs per parameter on the embedding
            if kind == "embed":
                flops = 3e-4
        else:
            params, flops = rng.randint(5_000, 20_000), rng.uniform(1e-3, 3e-3)
        layers.append(_layer(rng, f"l{i}", kind, params, flops))
    kw.setdefault("link", LinkModel(latency_s=1e-4, bandwidth_Bps=1e8))
    return PlanningProblem(layers=layers, **kw)


def _brute_force(prob: PlanningProblem, k: Knobs) -> float:
    L, p = len(prob.layers), k.pipeline_degree
    options = [(lv, r, keep) for lv in stage_levels(prob, k) for r, keep in prob.recompute_options()]
    best = float("inf")
    for cuts in combinations(range(1, L), p - 1):
        b = [0, *cuts, L]
        for opts in product(options, repeat=p):
            stages = [StageChoice(i, j, lv, r, keep) for (i, j), (lv, r, keep) in zip(zip(b, b[1:]), opts)]
            ev = evaluate_stages(prob, k, stages)
            if ev["fits"]:
                best = min(best, ev["pipeline_time"])
    return best


def _knobs(p: int, b: int, m: int, **kw) -> Knobs:
    from deepspeed_ppq.autotune.costs import NO_CODEC

    d = dict(schedule="1f1b", activation_codec=NO_CODEC, gradient_codec=NO_CODEC, optimizer_8bit=False)
    d.update(kw)
    return Knobs(p, b, m, **d)


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    L, p = rng.choice([(5, 2), (6, 3), (7, 3)])
    # partial recomputation: keeping the last layer, or 1 or 2 on two stages (the brute force grows as
    # (levels x recompute choices) ^ stages)
    prob = _problem(seed, L, world_size=p, global_batch=8, recompute_keep=(1, 2) if p == 2 else (1,))
    k = _knobs(
        p,
        rng.choice([1, 2]),
        rng.choice([2, 4, 8]),
        schedule=rng.choice(["1f1b", "gpipe"]),
        optimizer_8bit=bool(seed % 2),
    )
    # a budget that binds: between the smallest and largest stage memory of an even split
    free = evaluate_stages(
        prob, k, [StageChoice(i * L // p, (i + 1) * L // p, "none", False) for i in range(p)]
    )
    peaks = sorted(sum(mm.values()) for mm in free["memory"])
    prob.memory_budget = int(peaks[0] + rng.uniform(0.2, 0.9) * (peaks[-1] - peaks[0]))
    expected = _brute_force(prob, k)
    got = solve_partition(prob, k)
    if expected == float("inf"):
        assert got is None
        return
    value, stages = got
    assert value == pytest.approx(expected, rel=1e-12)
    ev = evaluate_stages(prob, k, stages)  # the DP's tables agree with the loop-by-loop model
    assert ev["fits"] and ev["pipeline_time"] == pytest.approx(value, rel=1e-12)


def test_whole_search_equals_brute_force_over_knobs():
    codecs = [
        CodecOption.make({"method": "none"}),
        CodecOption.make(
            {"method": "quant", "bits": 8},
            wire_ratio=0.26,
            encode_s_per_byte=2e-9,
            decode_s_per_byte=1e-9,
            bits=8,
        ),
    ]
    prob = _problem(
        3,
        6,
        world_size=3,
        global_batch=8,
        pipeline_degrees=[1, 3],
        micro_batch_sizes=[1, 2, 4],
        activation_codecs=codecs,
        gradient_codecs=codecs,
        optimizer_8bit=[False, True],
        recompute_keep=(),  # all or nothing here: test_dp_equals_brute_force covers partial recomputation
    )
    prob.memory_budget = 450_000
    plan = plan_pipeline(prob)
    best = float("inf")
    for p, b in product([1, 3], [1, 2, 4]):
        for a, g, o8 in product(codecs, codecs, [False, True]):
            best = min(
                best,
                _brute_force(
                    prob, _knobs(p, b, 8 // b, activation_codec=a, gradient_codec=g, optimizer_8bit=o8)
                ),
            )
    assert plan.predicted_step_time == pytest.approx(best, rel=1e-12)
    assert all(s.peak_memory <= prob.memory_budget for s in plan.stages)


def test_heavy_embedding_and_head_beat_deepspeed_partitions():
    prob = _problem(
        0,
        18,
        heavy_ends=True,
        world_size=4,
        global_batch=16,
        micro_batch_sizes=[1, 2, 4],
        pipeline_degrees=[4],
    )
    tuned = plan_pipeline(prob)
    for method in ("parameters", "uniform"):
        base = baseline_plan(prob, method)
        assert tuned.predicted_step_time < base.predicted_step_time, method
        # same knobs, only the partition differs: the DP alone must beat DeepSpeed's split
        k = _knobs(4, base.micro_batch_size, base.num_microbatches)
        assert (
            solve_partition(prob, k)[0]
            < evaluate_stages(prob, k, [StageChoice(*s.layers, "none", s.recompute) for s in base.stages])[
                "pipeline_time"
            ]
        )


def test_freed_memory_goes_to_pipeline_fill():
    """Micro-batch fixed at 4: fp32 Adam states force the baseline to recompute under this budget;
    8-bit states free enough memory to keep the activations, which is faster."""
    prob = _problem(
        5,
        10,
        world_size=2,
        global_batch=16,
        micro_batch_sizes=[4],
        pipeline_degrees=[2],
        optimizer_8bit=[False, True],
    )
    base_free = baseline_plan(prob)
    assert not any(s.recompute for s in base_free.stages)
    prob.memory_budget = int(max(s.peak_memory for s in base_free.stages) * 0.85)
    base = baseline_plan(prob)
    tuned = plan_pipeline(prob)
    assert all(s.recompute for s in base.stages)
    assert tuned.optimizer_8bit and not any(s.recompute for s in tuned.stages)
    assert all(s.peak_memory <= prob.memory_budget for s in tuned.stages)
    assert tuned.predicted_step_time < base.predicted_step_time


def test_leftover_memory_buys_back_recomputation():
    """Between what full recomputation and none need, a stage recomputes all of its layers but the
    last few: faster than recomputing all, within the budget; the plan's DeepSpeed config lists the
    recomputed layers and its Megatron flags use the block method (the first N layers of a stage)."""
    prob = _problem(5, 10, world_size=2, global_batch=16, micro_batch_sizes=[4], pipeline_degrees=[2])
    prob.layers = [dataclasses.replace(layer, allowed_formats=["none"]) for layer in prob.layers]
    free = plan_pipeline(prob)
    assert not any(s.recompute for s in free.stages)
    k = _knobs(2, 4, 4)
    full = evaluate_stages(prob, k, [StageChoice(*s.layers, "none", True) for s in free.stages])
    low = max(sum(m.values()) for m in full["memory"])
    prob.memory_budget = int(low + 0.5 * (max(s.peak_memory for s in free.stages) - low))
    plan = plan_pipeline(prob)
    partial = [s for s in plan.stages if s.recompute and s.keep_last]
    assert partial, [(s.recompute, s.keep_last) for s in plan.stages]
    assert all(s.peak_memory <= prob.memory_budget for s in plan.stages)
    all_rc = evaluate_stages(prob, k, [StageChoice(*s.layers, "none", s.recompute) for s in plan.stages])
    assert plan.predicted_step_time < all_rc["step_time"]
    cfg = plan.deepspeed_config()["pipeline"]
    expect = [i for s in plan.stages for i in range(s.layers[0], s.layers[1] - s.keep_last) if s.recompute]
    assert cfg["recompute_layers"] == expect and "recompute_stages" not in cfg
    n = max(sum(s.recomputes(i) for i in range(*s.layers)) for s in plan.stages)
    assert f"--recompute-method block --recompute-num-layers {n}" in " ".join(plan.megatron_flags())
    assert Plan.from_dict(plan.to_dict()).stages[0].keep_last == plan.stages[0].keep_last


def test_a_stage_may_keep_any_number_of_its_last_layers():
    """The budget between keeping 7 and 8 of a deep stage's layers gets 7 (not a coarser choice)."""
    prob = _problem(3, 16, world_size=1, global_batch=4, micro_batch_sizes=[4], pipeline_degrees=[1])
    prob.layers = [dataclasses.replace(layer, allowed_formats=["none"]) for layer in prob.layers]
    k = _knobs(1, 4, 1)

    def peak(keep: int) -> float:
        return sum(evaluate_stages(prob, k, [StageChoice(0, 16, "none", True, keep)])["memory"][0].values())

    peaks = [peak(n) for n in range(1, 15)]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)  # every kept layer costs memory
    prob.memory_budget = int((peak(7) + peak(8)) / 2)
    plan = plan_pipeline(prob)
    assert [(s.recompute, s.keep_last) for s in plan.stages] == [(True, 7)]
    prob.recompute_keep = (1, 2, 4, 8)  # a coarser set settles for fewer
    assert [(s.recompute, s.keep_last) for s in plan_pipeline(prob).stages] == [(True, 4)]


def test_low_bit_only_runs_every_stage_low_bit():
    """``low_bit_only`` (the report's "best plan with low-bit weights"): every stage at a low-bit level,
    its blocks in that format and the embedding and head in the training dtype; never faster than the
    free choice."""
    prob = _problem(2, 8, world_size=2, global_batch=8, pipeline_degrees=[2])
    free = plan_pipeline(prob)
    forced = plan_pipeline(dataclasses.replace(prob, low_bit_only=True))
    for sp in forced.stages:
        blocks = [f for i, f in zip(range(*sp.layers), sp.formats) if prob.layers[i].kind == "block"]
        assert blocks and all(f != "none" for f in blocks) and len(set(blocks)) == 1
    assert forced.layer_formats[0] == "none" and forced.layer_formats[-1] == "none"
    assert forced.predicted_step_time >= free.predicted_step_time
    # the tuner's note when its plan keeps the training dtype: the forced plan's figures against its own
    from deepspeed_ppq.autotune.loop import _low_bit_alternative

    notes = []
    stock = dataclasses.replace(free, stages=[dataclasses.replace(sp, formats=["none"] * len(sp.formats))
                                              for sp in free.stages])
    alt = _low_bit_alternative(prob, stock, notes.append)
    assert alt["fits"] and alt["predicted_step_time"] == pytest.approx(forced.predicted_step_time)
    assert "the best plan with low-bit weights on every stage (predicted, not run)" in notes[0]
    assert _low_bit_alternative(prob, forced, notes.append) is None and len(notes) == 1


def test_optimizer_kinds_are_charged_their_measured_cost():
    """8-bit states and the master-free update cost what the profiler measured (here 4x fp32 Adam for
    8-bit states, a ratio of the kind a CPU measures): each parameter is charged by what updates it, and
    the planner weighs that against what the freed memory buys."""
    from deepspeed_ppq.autotune.planner import optimizer_units

    prob = _problem(5, 10, world_size=2, global_batch=16, micro_batch_sizes=[4], pipeline_degrees=[2],
                    optimizer_8bit=[False, True], master_free=[False, True], optimizer_s_per_param=1e-6,
                    optimizer_cost_ratio={"adam8bit": 4.0, "master_free": 2.0, "master_free_8bit": 5.0})
    block = prob.layers[3]  # param_numels [params, 64]: the 64-value bias keeps fp32 states
    n = block.param_numels[0]
    assert optimizer_units(prob, _knobs(2, 4, 2), block, "none") == n + 64
    assert optimizer_units(prob, _knobs(2, 4, 2, optimizer_8bit=True), block, "none") == 4 * n + 64
    assert optimizer_units(prob, _knobs(2, 4, 2, master_free=True), block, "int8") == 2 * n + 64
    both = _knobs(2, 4, 2, optimizer_8bit=True, master_free=True)
    assert optimizer_units(prob, both, block, "int8") == 5 * n + 64
    assert optimizer_units(prob, _knobs(2, 4, 2, master_free=True), block, "none") == n + 64
    free = plan_pipeline(prob)  # no budget: nothing to buy with the slower optimizers
    assert not free.optimizer_8bit and not free.master_free
    levels = [next((f for f in s.formats if f != "none"), "none") for s in free.stages]
    stages = [StageChoice(s.layers[0], s.layers[1], lv, s.recompute) for s, lv in zip(free.stages, levels)]
    pipeline = evaluate_stages(prob, _knobs(2, 4, free.num_microbatches), stages)["pipeline_time"]
    extras = free.predicted_step_time - pipeline
    params = [sum(layer.params for layer in prob.layers[s.layers[0] : s.layers[1]]) for s in free.stages]
    assert extras == pytest.approx(1e-6 * max(params))  # fp32 Adam on the larger stage
    # the budget of test_freed_memory_goes_to_pipeline_fill, where something must give: at 1 us/param
    # 4x dearer 8-bit states lose to recomputation; at 10 ns/param they are the cheaper way to fit
    prob.master_free = [False]
    prob.memory_budget = int(max(s.peak_memory for s in free.stages) * 0.85)
    dear = plan_pipeline(prob)
    assert not dear.optimizer_8bit and any(s.recompute for s in dear.stages)
    prob.optimizer_s_per_param = 1e-8
    cheap = plan_pipeline(prob)
    assert cheap.optimizer_8bit and not any(s.recompute for s in cheap.stages)


def test_infeasible_budget_names_smallest_fit():
    prob = _problem(1, 6, world_size=2, global_batch=4, micro_batch_sizes=[1, 2])
    prob.memory_budget = 1000
    with pytest.raises(
        InfeasibleBudgetError, match=r"memory_budget=1000 B .* smallest budget that fits is (\d+) B"
    ):
        plan_pipeline(prob)
    try:
        plan_pipeline(prob)
    except InfeasibleBudgetError as e:
        need = int(str(e).split("smallest budget that fits is ")[1].split(" B")[0])
        assert "optimizer" in str(e) and "weights" in str(e)
    prob.memory_budget = need  # the reported budget does fit
    assert max(s.peak_memory for s in plan_pipeline(prob).stages) <= need
    prob.memory_budget = need - 2
    with pytest.raises(InfeasibleBudgetError):
        plan_pipeline(prob)


def test_bad_batch_split_is_a_clear_error():
    prob = _problem(1, 4, world_size=2, global_batch=3, micro_batch_sizes=[2])
    with pytest.raises(ValueError, match="global_batch=3 cannot be split"):
        plan_pipeline(prob)


def test_optimizer_bytes_8bit():
    assert optimizer_bytes([100], True) == 800  # small tensors keep fp32 states
    assert optimizer_bytes([8192], False) == 65536 + 4
    assert optimizer_bytes([8192], True) == 2 * (8192 + 4 * 32)


def test_plan_json_round_trip_and_version(tmp_path):
    prob = _problem(2, 8, world_size=2, global_batch=8)
    plan = plan_pipeline(prob)
    path = tmp_path / "plan.json"
    plan.save(path)
    back = load_plan(path)
    assert back.to_dict() == plan.to_dict()
    d = json.loads(path.read_text())
    assert d["derived"]["deepspeed"]["ppq"]["partition"]["boundaries"] == plan.boundaries
    d["schema_version"] = PLAN_SCHEMA_VERSION + 1
    with pytest.raises(PlanError, match=f"schema_version={PLAN_SCHEMA_VERSION + 1} is not supported"):
        Plan.from_dict(d)
    flags = " ".join(plan.megatron_flags())
    assert "--pipeline-model-parallel-layout E" in flags and flags.count("|") == plan.pipeline_degree - 1
    assert f"--global-batch-size {plan.global_batch}" in flags


def test_back_off_removes_most_sensitive_format_then_codecs():
    from deepspeed_ppq.autotune.loop import back_off

    q8 = CodecOption.make({"method": "quant", "bits": 8}, wire_ratio=0.26, bits=8)
    q4 = CodecOption.make({"method": "quant", "bits": 4}, wire_ratio=0.14, bits=4)
    prob = _problem(4, 6, world_size=2, global_batch=8, pipeline_degrees=[2], activation_codecs=[q4, q8])
    prob.gradient_codecs = [q8]
    for i, layer in enumerate(prob.layers):
        layer.quant_error = {"int8": 0.01 * i, "nf4": 0.1 * i}
    prob.activation_codecs = [q4, q8]
    formats = ["none", "int8", "nf4", "nf4", "int8", "none"]
    plan = plan_pipeline(prob)
    plan.stages[0].formats = formats[: plan.stages[0].layers[1]]
    plan.stages[1].formats = formats[plan.stages[0].layers[1] :]
    assert "layer 3: nf4 removed" in back_off(plan, prob)
    assert "nf4" not in prob.layers[3].allowed_formats and "nf4" in prob.layers[2].allowed_formats
    for s in plan.stages:
        s.formats = ["none"] * len(s.formats)
    assert back_off(plan, prob) == "activation_codecs: quant4 removed"
    assert back_off(plan, prob) == "activation_codecs: quant8 removed"
    assert back_off(plan, prob) == "gradient_codecs: quant8 removed"
    assert back_off(plan, prob) is None


def test_plan_rules_from_linear_formats():
    plan = plan_pipeline(_problem(2, 6, world_size=2, global_batch=4))
    plan.linear_formats = {"2.attn.qkv": "int8", "3.mlp.fc": "nf4"}
    rules = plan.ppq_section()["weights"]["rules"]
    assert rules == [
        {"pattern": "2.attn.qkv", "format": "int8"},
        {"pattern": "3.mlp.fc", "format": "nf4"},
        {"pattern": "*", "format": "none"},
    ]
    from deepspeed_ppq.config import load_ppq_config

    load_ppq_config({"ppq": plan.ppq_section()})  # the section validates against the shared config


def test_optimizer_bytes_match_the_quant_ledger():
    from deepspeed_ppq.quant.optim import optimizer_state_bytes

    for n in (10, 4095, 4096, 5000, 65536):
        for kind, eight in (("adam", False), ("adam8bit", True)):
            assert optimizer_bytes([n], eight) == sum(optimizer_state_bytes(n, kind=kind).values()), (n, kind)


def test_simulator_agrees_with_the_closed_form_model():
    """Free link: the simulator's replay of DeepSpeed's TrainSchedule and the planner's closed form
    ``sum + (m - 1) max`` agree within 10% (the closed form is about 3% above here)."""
    from deepspeed_ppq.autotune.planner import simulate_plan

    prob = _problem(
        7,
        9,
        world_size=3,
        global_batch=12,
        micro_batch_sizes=[1],
        pipeline_degrees=[3],
        link=LinkModel(latency_s=0.0, bandwidth_Bps=1e18),
    )
    plan = plan_pipeline(prob)
    sim = simulate_plan(prob, plan)
    assert sim["step_time"] == pytest.approx(plan.predicted_step_time, rel=0.10)
    assert 0.0 <= sim["bubble_fraction"] < 1.0


def test_recompute_model_skips_the_embedding_like_the_runtime():
    """The loop checkpoints every layer but the embedding (its input is token ids): a recomputing
    stage pays the forward twice for the others only and keeps the embedding's saved ids."""
    from deepspeed_ppq.autotune.planner import stage_memory, stage_time

    prob = _problem(3, 5, world_size=2, global_batch=4, micro_batch_sizes=[2], pipeline_degrees=[2])
    k = _knobs(2, 2, 2)
    plain, rec = StageChoice(0, 3, "none", False), StageChoice(0, 3, "none", True)
    fwd = [layer.time("none", 2)[0] for layer in prob.layers[:3]]
    assert stage_time(prob, k, rec) - stage_time(prob, k, plain) == pytest.approx(fwd[1] + fwd[2])
    emb, b1, b2 = prob.layers[:3]
    kept = 2 * emb.saved_bytes["none"] + 2 * (b1.input_bytes + b2.input_bytes)  # per micro-batch
    # two micro-batches in flight; the one in its backward rebuilds b2 with all of its own kept, then b1
    # once b2's input is gone
    want = 2 * kept + max(2 * b2.saved_bytes["none"], 2 * b1.saved_bytes["none"] - 2 * b2.input_bytes)
    assert stage_memory(prob, k, rec, 0)["activations"] == want
    assert [layer.recomputable for layer in prob.layers] == [False, True, True, True, True]


def test_recomputed_layers_rebuild_their_activations_after_the_kept_ones_are_gone():
    """One micro-batch in flight, a stage [embedding, b1, b2, b3] recomputing b1 and b2 and keeping b3:
    the backward runs b3 first, with every kept activation; when b2 and b1 rebuild theirs, b3's are
    gone. The peak is the largest of those moments, not every kept activation plus the largest
    rebuild (the sweep's one stage of 8 x 1 keeping 6 blocks had been predicted over 67.2 MiB and
    measured 62.8)."""
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(3, 5, world_size=1, global_batch=2, micro_batch_sizes=[2], pipeline_degrees=[1])
    emb, b1, b2, b3 = prob.layers[:4]
    c = StageChoice(0, 4, "none", True, keep_last=1)
    rec = (False, True, True, False)
    tr = [layer.transient_bytes("none", r, 2) for layer, r in zip((emb, b1, b2, b3), rec)]
    kept = [2 * emb.saved_bytes["none"], 2 * b1.input_bytes, 2 * b2.input_bytes, 2 * b3.saved_bytes["none"]]
    moments = [kept[0] + tr[0], sum(kept[:2]) + tr[1], sum(kept[:3]) + tr[2], sum(kept) + tr[3]]
    got = stage_memory(prob, _knobs(1, 2, 1), c, 0)["activations"]
    assert got == max(moments)
    assert tr[2] > tr[3] and got < sum(kept) + max(tr)  # what adding the largest rebuild on top gave


def test_master_free_frees_the_masters_and_searches_exactly():
    """Master-free int8 drops the 4 B/param fp32 master (so low-bit weights save memory in training);
    with it among the knobs the search still equals brute force, uses 8-bit levels only, and the plan
    renders ``weights.master = "none"``."""
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(6, 6, world_size=2, global_batch=8, pipeline_degrees=[2], micro_batch_sizes=[2, 4],
                    master_free=[False, True])
    k, kf = _knobs(2, 2, 4), _knobs(2, 2, 4, master_free=True)
    c = StageChoice(1, 4, "int8", False)
    plain, free = stage_memory(prob, k, c, 0), stage_memory(prob, kf, c, 0)
    assert plain["master_weights"] == 4 * sum(layer.quantizable_params for layer in prob.layers[1:4])
    assert free["master_weights"] == 0 and {x: free[x] for x in free if x != "master_weights"} == {
        x: plain[x] for x in plain if x != "master_weights"
    }
    assert stage_levels(prob, kf) == ["none", "int8"] and "nf4" in stage_levels(prob, k)
    with pytest.raises(ValueError, match="level 'nf4'"):
        stage_memory(prob, kf, StageChoice(1, 4, "nf4", False), 0)
    # 7% under the unconstrained peak: with fp32 masters a stage must recompute; master-free int8 keeps
    # the activations instead, which is faster
    prob.memory_budget = int(max(s.peak_memory for s in plan_pipeline(prob).stages) * 0.93)
    plan = plan_pipeline(prob)
    best = min(
        _brute_force(prob, _knobs(2, b, 8 // b, master_free=mf)) for b, mf in product([2, 4], [False, True])
    )
    assert plan.predicted_step_time == pytest.approx(best, rel=1e-12)
    assert plan.master_free and "int8" in plan.layer_formats and not any(s.recompute for s in plan.stages)
    assert set(plan.layer_formats) <= {"none", "int8"}
    assert plan.ppq_section()["weights"]["master"] == "none"
    with_masters = plan_pipeline(PlanningProblem(**{**prob.__dict__, "master_free": [False]}))
    assert any(s.recompute for s in with_masters.stages)
    assert with_masters.predicted_step_time > plan.predicted_step_time
    assert with_masters.ppq_section()["weights"]["master"] == "fp32"


def test_master_free_bf16_gradients_halve_their_buffers():
    """``master_free_grad_dtype="bf16"``: a master-free weight's gradient buffer costs 2 B/param instead
    of 4 (the other trainable parameters keep fp32 gradients); the plan renders ``weights.grad_dtype``, a
    plan with fp32 masters keeps fp32 gradients, and a name that is not a dtype is refused."""
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(6, 6, world_size=2, global_batch=8, pipeline_degrees=[2], master_free=[True])
    half = PlanningProblem(**{**prob.__dict__, "master_free_grad_dtype": "bf16"})
    kf, c = _knobs(2, 2, 4, master_free=True), StageChoice(1, 4, "int8", False)
    q = sum(layer.quantizable_params for layer in prob.layers[1:4])
    full, lean = stage_memory(prob, kf, c, 0), stage_memory(half, kf, c, 0)
    assert full["gradients"] - lean["gradients"] == 2 * q > 0
    assert {x: lean[x] for x in lean if x != "gradients"} == {x: full[x] for x in full if x != "gradients"}
    plan = plan_pipeline(half)
    assert plan.master_free and plan.ppq_section()["weights"]["grad_dtype"] == "bf16"
    masters = plan_pipeline(PlanningProblem(**{**half.__dict__, "master_free": [False]}))
    assert masters.ppq_section()["weights"]["grad_dtype"] == "fp32"
    with pytest.raises(ValueError, match="master_free_grad_dtype='fp16'"):
        stage_memory(PlanningProblem(**{**prob.__dict__, "master_free_grad_dtype": "fp16"}), kf, c, 0)


def test_gradients_made_in_backward_are_not_counted_under_the_activations():
    """With ``grads_freed_after_step`` (DeepSpeed frees ``.grad`` after its step), a stage that runs all of
    a step's forwards before its first backward makes its gradients during that backward while its
    activations go: the pipeline-phase peak is the largest over the backward of the activations still
    kept plus the gradients made so far; the step phase holds every gradient. A stage that runs a
    forward after a backward (more micro-batches than in flight) holds both, as before; master-free
    gradient buffers stay allocated."""
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(6, 6, world_size=1, global_batch=4, pipeline_degrees=[1], master_free=[False, True])
    freed = PlanningProblem(**{**prob.__dict__, "grads_freed_after_step": True})
    c = StageChoice(0, 6, "none", False)
    one, two = _knobs(1, 4, 1), _knobs(1, 2, 2)  # 4 x 1: every forward first; 2 x 2: a forward after
    assert stage_memory(freed, two, c, 0) == stage_memory(prob, two, c, 0)
    held, lean = stage_memory(prob, one, c, 0), stage_memory(freed, one, c, 0)
    kept = [layer.saved_bytes["none"] * 4 for layer in prob.layers]
    grads = [4 * layer.params for layer in prob.layers]
    peak = max(sum(kept[: t + 1]) + sum(grads[t:]) for t in range(6))
    assert held["gradients"] == sum(grads) and held["temporaries"] == 0  # no step transient here
    assert sum(held.values()) - sum(lean.values()) == sum(kept) + sum(grads) - peak > 0
    assert {x: lean[x] for x in lean if x != "gradients"} == {x: held[x] for x in held if x != "gradients"}
    # a step transient larger than the activations: the step phase (every gradient) is the peak again
    big = PlanningProblem(**{**freed.__dict__, "step_fixed_bytes": float(sum(kept) + sum(grads))})
    step = stage_memory(big, one, c, 0)
    assert sum(step.values()) == sum(held.values()) - held["activations"] + big.step_fixed_bytes
    # master-free weights keep their gradient buffers: only the other parameters' .grad is made late
    kf, cq = _knobs(1, 4, 1, master_free=True), StageChoice(0, 6, "int8", False)
    q_bytes = 4 * sum(layer.quantizable_params for layer in prob.layers)
    assert (sum(stage_memory(prob, kf, cq, 0).values()) - sum(stage_memory(freed, kf, cq, 0).values())
            < sum(held.values()) - sum(lean.values()))
    assert sum(layer.freed_grad_bytes("int8", True) for layer in prob.layers) == sum(grads) - q_bytes


def test_master_free_weights_updated_in_backward_hold_no_gradient_buffer(monkeypatch):
    """Where the engine updates master-free weights in their backward (one micro-batch per step, no
    clipping: ``master_free_update_in_backward``), a master-free stage holds no gradient buffer for
    them, only a workspace of the buffer's dtype (bf16: half the fp32 dequantization buffer); with two
    micro-batches per step the buffer stays. With replicas the gradients wait for their all-reduce in a
    bucket holding all of the stage's, or two of ``IN_BACKWARD_BUCKET`` values where they do not fit one
    (one fills while the other is all-reduced)."""
    from deepspeed_ppq.autotune import planner
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(6, 6, world_size=1, global_batch=4, pipeline_degrees=[1], master_free=[False, True],
                    master_free_grad_dtype="bf16")
    live = PlanningProblem(**{**prob.__dict__, "master_free_update_in_backward": True})
    c = StageChoice(0, 6, "int8", False)
    one, two = _knobs(1, 4, 1, master_free=True), _knobs(1, 2, 2, master_free=True)
    assert stage_memory(live, two, c, 0) == stage_memory(prob, two, c, 0)
    held, lean = stage_memory(prob, one, c, 0), stage_memory(live, one, c, 0)
    q = sum(layer.quantizable_params for layer in prob.layers)
    ws = max(layer.workspace_bytes.get("int8", 0) for layer in prob.layers)
    assert q > 0 and ws > 0
    assert held["gradients"] - lean["gradients"] == 2 * q  # the bf16 buffer
    assert lean["weights"] - held["weights"] == ws // 2
    assert {x: lean[x] for x in lean if x not in ("gradients", "weights")} == {
        x: held[x] for x in held if x not in ("gradients", "weights")}
    # two replicas of the one stage: a bucket as large as the stage's gradients holds them all; smaller
    # ones, two of their size
    dp = PlanningProblem(**{**live.__dict__, "world_size": 2, "global_batch": 8})
    assert stage_memory(dp, one, c, 0)["gradients"] == held["gradients"]
    monkeypatch.setattr(planner, "IN_BACKWARD_BUCKET", q // 2)
    assert stage_memory(dp, one, c, 0)["gradients"] == held["gradients"]
    monkeypatch.setattr(planner, "IN_BACKWARD_BUCKET", 1000)
    assert stage_memory(dp, one, c, 0)["gradients"] == lean["gradients"] + 2 * 2 * 1000


def test_step_transient_counts_the_parameters_the_engine_steps():
    """The engine's step transient (DeepSpeed flattens the gradients it reduces) scales with the parameters
    whose ``.grad`` it reduces and steps: a master-free weight has its own gradient buffer and update, so
    a master-free int8 stage's step phase holds 4 B per such value less of it."""
    from deepspeed_ppq.autotune.planner import stage_memory

    prob = _problem(6, 6, world_size=1, global_batch=4, pipeline_degrees=[1], master_free=[False, True],
                    step_transient_bytes_per_param=4.0)
    c = StageChoice(0, 6, "int8", False)
    plain = stage_memory(prob, _knobs(1, 1, 4), c, 0)
    free = stage_memory(prob, _knobs(1, 1, 4, master_free=True), c, 0)
    params = sum(layer.params for layer in prob.layers)
    q = sum(layer.quantizable_params for layer in prob.layers)
    assert q > 0 and plain["temporaries"] > 0 and free["temporaries"] > 0  # the step phase is the peak
    assert plain["temporaries"] == int(4 * params - plain["activations"])
    assert free["temporaries"] == int(4 * (params - q) - free["activations"])
    assert sum(layer.engine_params("int8", True) for layer in prob.layers) == params - q


def test_bf16_mode_partitions_masters_and_states_over_the_replicas():
    """DeepSpeed's bf16 mode (BF16_Optimizer) keeps fp32 masters of the parameters it steps and their
    optimizer states partitioned over the data-parallel replicas, and an fp32 gradient buffer whole; a
    master-free weight keeps its own gradient buffer and states, and a low-bit layer's own master is a
    bf16 parameter there."""
    from deepspeed_ppq.autotune.costs import optimizer_bytes

    layer = _problem(1, 3, world_size=1, global_batch=4).layers[1]
    P, q = layer.params, layer.quantizable_params
    assert 0 < q < P
    opt = optimizer_bytes(layer.param_numels, False)
    plain = layer.static_bytes("none", False)
    for dp in (1, 2, 4):
        bf = layer.static_bytes("none", False, bf16_replicas=dp)
        assert bf["master_weights"] == -(-4 * P // dp) and bf["gradients"] == plain["gradients"] == 4 * P
        assert bf["optimizer"] == -(-opt // dp)
        free = layer.static_bytes("int8", False, master_free=True, master_free_grad_bytes=2, bf16_replicas=dp)
        engine_opt = opt * (P - q) // P
        assert free["master_weights"] == -(-4 * (P - q) // dp)
        assert free["optimizer"] == opt - engine_opt + -(-engine_opt // dp)
        assert free["gradients"] == 4 * P - 2 * q
        kept = layer.static_bytes("int8", False, bf16_replicas=dp)  # a bf16 master and its fp32 master
        assert kept["master_weights"] == 2 * q + -(-4 * P // dp)
    # each replica steps its partition of the engine's parameters; a master-free weight's update is whole
    from deepspeed_ppq.autotune.planner import optimizer_units

    prob = _problem(1, 3, world_size=2, global_batch=4, bf16_mode=True)
    fp32 = _problem(1, 3, world_size=2, global_batch=4)
    one, two = _knobs(1, 2, 1), _knobs(2, 2, 1)  # one stage on 2 replicas; two stages, one replica
    half = optimizer_units(fp32, one, layer, "none") / 2
    assert optimizer_units(prob, one, layer, "none") == pytest.approx(half)
    assert optimizer_units(prob, two, layer, "none") == optimizer_units(fp32, two, layer, "none")


@pytest.mark.parametrize("seed", range(9))
def test_segment_tables_equal_stage_memory(seed, monkeypatch):
    """The DP's vectorised memory tables give, for every stage position and segment, the smallest of
    ``stage_memory`` over the stage options: recomputation (partial too), master-free levels, a step
    transient, gradients made in the backward (GPipe, or no more micro-batches than in flight),
    master-free weights updated there and DeepSpeed's bf16 mode (masters and states partitioned)."""
    from deepspeed_ppq.autotune import planner
    from deepspeed_ppq.autotune.planner import _segment_tables, stage_memory

    rng = random.Random(200 + seed)
    L, p = rng.choice([(5, 1), (6, 2), (7, 3)])
    # seeds 0 and 1 with two replicas and a bucket smaller than some segments' master-free gradients
    monkeypatch.setattr(planner, "IN_BACKWARD_BUCKET", 15_000)
    # activations of micro-batch 2 or 4 against gradients of the same order, a step transient that
    # sometimes binds
    prob = _problem(seed, L, world_size=p * (2 if seed < 2 else 1), global_batch=8, recompute_keep=(1, 2),
                    allow_recompute=seed % 3 != 1, grads_freed_after_step=seed % 3 != 2,
                    step_transient_bytes_per_param=rng.choice([0.0, 1.0]),
                    step_fixed_bytes=rng.uniform(0, 20_000), activation_extra_bytes={1: 3000.0},
                    master_free_update_in_backward=seed % 5 < 3,
                    master_free_grad_dtype=["fp32", "bf16"][seed % 2], bf16_mode=seed % 3 == 0)
    # seeds 0 and 1: master-free weights updated in the backward (one micro-batch), fp32 and bf16
    m = 1 if seed < 2 else rng.choice([1, 2, 4])
    k = _knobs(p, rng.choice([2, 4]), m, schedule=rng.choice(["1f1b", "gpipe"]),
               optimizer_8bit=bool(seed % 2), master_free=seed % 4 < 2)
    tabs = _segment_tables(prob, k)
    for s in range(p):
        for i in range(L):
            for j in range(i + 1, L + 1):
                want = min(sum(stage_memory(prob, k, StageChoice(i, j, lv, r, min(keep, j - i)), s).values())
                           for lv, r, keep in tabs.options)
                assert tabs.min_memory[s, i, j] == pytest.approx(want, abs=2.0), (s, i, j)  # int bytes


def test_back_off_gives_masters_back_first():
    from deepspeed_ppq.autotune.loop import back_off

    prob = _problem(4, 6, world_size=2, global_batch=8, pipeline_degrees=[2], master_free=[False, True])
    plan = plan_pipeline(prob)
    plan.master_free = True
    plan.stages[0].formats = ["none"] + ["int8"] * (len(plan.stages[0].formats) - 1)
    assert "master-free weights removed" in back_off(plan, prob)
    assert prob.master_free == [False]
    plan.master_free = False
    assert "int8 removed" in back_off(plan, prob)


def _fewer_stages_case():
    """A problem on 1 or 2 stages, DeepSpeed's 'parameters' cuts, the best stock configuration (2 stages)
    and a plan on one stage (the other rank data parallel): micro-batch 2, 8-bit Adam."""
    from deepspeed_ppq.integrations.model_layers import deepspeed_partitions

    prob = _problem(3, 6, world_size=2, global_batch=8, pipeline_degrees=[1, 2])
    counts = [layer.params for layer in prob.layers]
    partitions = {p: {"parameters": deepspeed_partitions(counts, p)["parameters"]} for p in (1, 2)}
    base = best_stock(prob, {2: partitions[2]})
    tuned = plan_pipeline(_problem(3, 6, world_size=2, global_batch=8, pipeline_degrees=[1],
                                   micro_batch_sizes=[2], optimizer_8bit=[True]))
    return prob, partitions, base, tuned


def test_ladder_spends_freed_memory_on_fewer_stages():
    """When the tuned plan runs fewer pipeline stages than the best stock configuration, the fill rung
    is that degree, cut as stock DeepSpeed cuts it, with the tuned micro-batches; the rungs climb one
    feature at a time from the stock configuration to the tuned plan."""
    from deepspeed_ppq.autotune.ladder import ladder_plans, left_out_codecs

    prob, partitions, base, tuned = _fewer_stages_case()
    assert tuned.pipeline_degree == 1 and tuned.optimizer_8bit
    rungs = ladder_plans(prob, base, tuned, partitions)
    labels = [label for label, _ in rungs]
    assert labels[0].startswith("+ low-bit weights")
    assert rungs[0][1].pipeline_degree == 2 and rungs[0][1].boundaries == base.boundaries
    fill = next(plan for label, plan in rungs if "2 -> 1 pipeline stages" in label)
    assert fill.pipeline_degree == 1 and fill.boundaries == [0, 6]
    assert (fill.micro_batch_size, fill.num_microbatches) == (2, 2)
    assert rungs[-1][1] is tuned
    # the last rung names what the tuned plan changes after the fill rung: here nothing
    assert labels[-1] == "+ re-balanced stages (the tuned plan)"
    # no codec rung, and the report says why: one stage has no traffic between stages
    assert "one stage" in left_out_codecs(tuned)
    assert "no codec candidate" in left_out_codecs(base)
    assert left_out_codecs(dataclasses.replace(tuned, activation_codec={"method": "kbit", "bits": 8})) is None


def test_ladder_says_which_rungs_it_leaves_out():
    """The measured ladder leaves out a rung equal to the one before it and says so, with why; when that
    rung was the tuned plan, the rung before it is marked the tuned plan. Without codecs the report says
    why there is no codec rung. (Trials scripted: the rungs' configurations are what is checked.)"""
    from types import SimpleNamespace

    from deepspeed_ppq.autotune.loop import _measure_ladder, _Tuning, same_configuration, summarize
    from deepspeed_ppq.config import AutotuneConfig

    prob, partitions, base, tuned = _fewer_stages_case()

    def trial(plan, settings, seed=0, timing_only=False):
        stages = [SimpleNamespace(stage=i, memory={"total": 1}, device_max_allocated=0,
                                  instructions={"ForwardPass": 0.01}) for i in range(plan.pipeline_degree)]
        return SimpleNamespace(stages=stages, step_time=0.1, step_times=[0.1], val_loss=1.0, peak_memory=1,
                               wire={})

    measured = []
    t = _Tuning(SimpleNamespace(log=lambda msg: None, run_trial=lambda plan, *a, **k: measured.append(plan)
                                or trial(plan, None)),
                AutotuneConfig(ab_repeats=0), global_batch=8, profile=SimpleNamespace(threads_per_rank=1))
    t.quality = lambda plan, seed: measured.append(plan) or 1.0
    res = SimpleNamespace(base=base, base_run=summarize(base, trial(base, None)))
    accepted = (tuned, {**summarize(tuned, trial(tuned, None)), "quality_val_loss": 0.9})
    ladder, left_out = _measure_ladder(t, SimpleNamespace(problem=prob, partitions=partitions), res, accepted,
                                       [1.0])
    # the fill rung runs as the tuned plan: its trial and quality run are the tuned plan's, not run again
    assert len(measured) == 2 and not same_configuration(measured[0], tuned)
    assert ladder[-1]["run"]["quality_val_loss"] == 0.9
    assert [rec["rung"] for rec in ladder] == [
        "best stock configuration", "+ low-bit weights and optimizer states at the stock schedule",
        "+ freed memory spent on fill (2 -> 1 pipeline stages, micro-batches, recomputation) "
        "(the tuned plan)"]
    assert left_out == [
        "+ re-balanced stages: the same configuration as the rung before it "
        "(one stage: no boundary to move)",
        "+ compressed boundaries: the tuned plan runs one stage, so no traffic goes between stages"]


def test_rebalance_rung_names_what_changes():
    """After the fill rung (one level on every stage at the stock cut), the tuned plan may move the
    boundaries, give each stage its own precision, or both; the rung says which."""
    import copy

    from deepspeed_ppq.autotune.ladder import rebalance_label

    fill = plan_pipeline(_problem(4, 6, world_size=2, global_batch=8, pipeline_degrees=[2]))
    precision, moved = copy.deepcopy(fill), copy.deepcopy(fill)
    precision.stages[1].formats = ["int8"] * len(precision.stages[1].formats)
    a, b = moved.stages
    b.layers, b.formats = (b.layers[0] - 1, b.layers[1]), [a.formats[-1], *b.formats]
    a.layers, a.formats = (a.layers[0], a.layers[1] - 1), a.formats[:-1]
    assert rebalance_label(fill, fill) == "+ re-balanced stages"
    assert rebalance_label(fill, precision) == "+ re-balanced stages (each stage's precision)"
    assert rebalance_label(fill, moved) == "+ re-balanced stages (boundaries)"
    moved.stages[1].formats = ["int8"] * len(moved.stages[1].formats)
    assert rebalance_label(fill, moved) == "+ re-balanced stages (boundaries and each stage's precision)"


def test_runner_up_is_the_best_plan_of_another_schedule():
    """``exclude`` leaves out (pipeline degree, micro-batch size) pairs: the tuning loop's runner-up is the
    best plan of another schedule, predicted no faster than the best plan, and it equals the best plan of
    the space restricted to the other schedules."""
    prob = _problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[1, 2])
    best = plan_pipeline(prob)
    key = (best.pipeline_degree, best.micro_batch_size)
    alt = plan_pipeline(prob, exclude=frozenset({key}))
    assert (alt.pipeline_degree, alt.micro_batch_size) != key
    assert alt.predicted_step_time >= best.predicted_step_time
    others = [b for b in prob.micro_batch_sizes if (best.pipeline_degree, b) != key]
    for p in (1, 2):  # the restricted spaces, one degree at a time: the runner-up is the best of them
        bs = others if p == best.pipeline_degree else prob.micro_batch_sizes
        if not bs:
            continue
        try:
            sub = plan_pipeline(_problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[p],
                                         micro_batch_sizes=bs))
        except InfeasibleBudgetError:
            continue
        assert alt.predicted_step_time <= sub.predicted_step_time + 1e-12


def test_stock_final_picks_the_lowest_median_not_a_lucky_trial():
    """The stock configurations whose first trial came within ``stock_margin`` of the fastest are timed
    ``ab_repeats`` more times, alternating, and the lowest median is the baseline: one lucky first trial
    does not make a configuration the baseline; one outside the margin is not re-timed."""
    from types import SimpleNamespace

    from deepspeed_ppq.autotune.loop import _stock_final, _Tuning
    from deepspeed_ppq.config import AutotuneConfig

    prob = _problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[2])
    plans = {n: dataclasses.replace(baseline_plan(prob), notes=[n]) for n in ("lucky", "steady", "slow")}
    later = {"lucky": [0.130, 0.125], "steady": [0.110, 0.112], "slow": [0.090, 0.090]}
    calls = []

    class Runner:
        def log(self, msg):
            pass

        def run_trial(self, plan, settings, seed=0, steps=None, timing_only=False):
            assert timing_only
            name = plan.notes[0]
            calls.append(name)
            return SimpleNamespace(step_time=later[name][sum(c == name for c in calls) - 1])

    fits = [{"plan": plans[n].to_dict(), "run": {"measured_step_time": t}}
            for n, t in (("lucky", 0.100), ("steady", 0.108), ("slow", 0.140))]
    t = _Tuning(Runner(), AutotuneConfig(stock_margin=0.15, ab_repeats=2), global_batch=8)
    best = _stock_final(t, fits)
    assert best["plan"]["notes"] == ["steady"]
    assert calls == ["lucky", "steady", "lucky", "steady"]  # alternating; "slow" (40% over) not re-timed
    assert best["final_step_times"] == [0.108, 0.110, 0.112]
    assert t.log and t.log[0].startswith("stock final: the 2 configurations within 15% of the fastest")
    # without repeats, the fastest first trial stands
    calls.clear()
    best = _stock_final(_Tuning(Runner(), AutotuneConfig(ab_repeats=0), global_batch=8), fits)
    assert best["plan"]["notes"] == ["lucky"]
    assert not calls


def test_activation_extra_bytes_are_fitted_per_micro_batch_size_and_added_per_stage():
    """The bytes the engine holds beyond the profile are kept per micro-batch size measured (the largest
    over the stages), added to every stage as bytes, not as a ratio of its activations: a stage twice as
    large does not hold twice the pipeline's extra buffers. A size without a trial takes the nearest
    smaller size's bytes, below every measured size the smallest's; an excess below the profile counts 0;
    a later calibration never lowers them."""
    from deepspeed_ppq.autotune.calibrate import calibrate_memory, predict

    prob = _problem(5, 8, world_size=2, global_batch=8, pipeline_degrees=[2], micro_batch_sizes=[1, 2, 4],
                    allow_recompute=False)
    plans = {b: plan_pipeline(dataclasses.replace(prob, micro_batch_sizes=[b])) for b in (1, 2, 4)}
    profiled = {b: predict(prob, plans[b])["memory"] for b in plans}

    def run(b: int, extras: list[float]) -> dict:
        return {"stages": [{"measured_memory": {"total": sum(m.values()), "phases": {
            "pipeline": {"activations": m["activations"] + m["comm_buffers"] + x}}}}
            for m, x in zip(profiled[b], extras)]}

    cal = calibrate_memory(prob, [(plans[1], run(1, [1 * MIB, 2.5 * MIB])),
                                  (plans[2], run(2, [3 * MIB, -MIB]))])
    assert cal["activation_extra_bytes"] == pytest.approx({1: 2.5 * MIB, 2: 3 * MIB})
    assert [prob.activation_extra_for(b) / MIB for b in (1, 2, 3, 4, 8)] == pytest.approx([2.5, 3, 3, 3, 3])
    for m, m0 in zip(predict(prob, plans[4])["memory"], profiled[4]):
        assert m["activations"] == pytest.approx(m0["activations"] + 3 * MIB, abs=1)
        assert m["comm_buffers"] == m0["comm_buffers"]
    # one stage holding every layer: the same bytes on top, not the two stages' ratio
    whole = plan_pipeline(dataclasses.replace(prob, pipeline_degrees=[1], micro_batch_sizes=[2]))
    bare = dataclasses.replace(prob, activation_extra_bytes={})
    (m,), (m0,) = predict(prob, whole)["memory"], predict(bare, whole)["memory"]
    assert m["activations"] == pytest.approx(m0["activations"] + 3 * MIB, abs=1)
    # a smaller excess later leaves the bytes as they are; below every measured size: the smallest's
    calibrate_memory(prob, [(plans[1], run(1, [0.5 * MIB, 0.5 * MIB]))])
    assert prob.activation_extra_for(1) == pytest.approx(2.5 * MIB)
    prob.activation_extra_bytes = {2: 1.5 * MIB, 4: 2 * MIB}
    assert prob.activation_extra_for(1) == pytest.approx(1.5 * MIB)
    assert bare.activation_extra_for(4) == 0.0
    # an excess below the profile counts 0
    fresh = dataclasses.replace(prob, activation_extra_bytes={})
    cal = calibrate_memory(fresh, [(plans[2], run(2, [-MIB, -2 * MIB]))])
    assert cal["activation_extra_bytes"] == {2: 0.0}


class _StockRunner:
    """A scripted runner for the stock search over ``_stock_profile``'s model: ``trial(plan)`` gives each
    trial's ``TrialResult``; ``runs`` lists the configurations run."""

    world_size = 2

    def __init__(self, cuts: dict, trial):
        self.cuts, self.trial, self.runs = cuts, trial, []

    def log(self, msg):
        pass

    def stock_partitions(self, p):
        return self.cuts[p]

    def run_trial(self, plan, settings, seed=0, steps=None, timing_only=False):
        self.runs.append(plan.notes[0])
        return self.trial(plan)


def _stock_profile(adam8bit_s_per_param: float):
    """An 8-layer model for the stock search: DeepSpeed's partitions at 1 and 2 stages, its profile, and
    every stock candidate's predicted memory per stage (before any trial)."""
    from deepspeed_ppq.autotune.calibrate import predict
    from deepspeed_ppq.autotune.costs import NO_CODEC
    from deepspeed_ppq.autotune.loop import _Tuning
    from deepspeed_ppq.autotune.planner import stock_candidates
    from deepspeed_ppq.autotune.runner import Profile
    from deepspeed_ppq.config import AutotuneConfig
    from deepspeed_ppq.integrations.model_layers import deepspeed_partitions

    layers = _problem(7, 8, world_size=2, global_batch=8).layers
    cuts = {p: deepspeed_partitions([layer.params for layer in layers], p) for p in (1, 2)}
    profile = Profile(layers=layers, codecs=[NO_CODEC], link=LinkModel(latency_s=1e-4, bandwidth_Bps=1e8),
                      optimizer_costs={"adam": 1e-9, "adam8bit": adam8bit_s_per_param})
    prob = _Tuning(SimpleNamespace(world_size=2), AutotuneConfig(), global_batch=8, profile=profile).problem()
    cands = stock_candidates(prob, cuts)
    return cuts, profile, cands, {c.notes[0]: predict(prob, c)["memory"] for c in cands}


def _measured(pred: list[dict], f: float, step_total: float | None = None) -> list:
    """Stage measurements of a trial: ``f`` x the predicted peak; the pipeline phase's activations as
    predicted; the step phase's total ``step_total`` (default: the peak)."""
    from deepspeed_ppq.autotune.runner import StageMeasurement

    out = []
    for i, m in enumerate(pred):
        total = f * sum(m.values())
        phases = {"pipeline": {"activations": m["activations"] + m["comm_buffers"]},
                  "step": {"total": total if step_total is None else step_total}}
        out.append(StageMeasurement(i, {"ForwardPass": 0.01}, {"total": total, "phases": phases}))
    return out


def test_stock_search_measures_the_smallest_configuration_when_none_fits():
    """When every stock configuration measured breaks the budget, the one the model predicts smallest is
    measured too, although the model refitted to those trials puts it over: it fits by its own measured
    peak, and it is the baseline (it had never been run, and stock was said not to train there)."""
    from deepspeed_ppq.autotune.loop import _search_stock, _Tuning
    from deepspeed_ppq.autotune.runner import TrialResult
    from deepspeed_ppq.config import AutotuneConfig

    cuts, profile, cands, predicted = _stock_profile(2e-9)
    settings = AutotuneConfig(ab_repeats=0, stock_trials=2)

    def trial(plan):
        # the first (the fastest) measures twice its prediction, around the optimizer step too; the
        # others as predicted
        f = 2 if len(runner.runs) == 1 else 1
        return TrialResult([0.1, 0.1, 0.1], 1, 1.0, _measured(predicted[plan.notes[0]], f))

    runner = _StockRunner(cuts, trial)
    t = _Tuning(runner, settings, global_batch=8, profile=profile)
    # the fastest may fit by the prediction: it is measured first, comes out over, and the model refitted
    # to it puts every configuration over
    fastest = min(cands, key=lambda c: c.predicted_step_time)
    settings.memory_budget = int(max(sp.peak_memory for sp in fastest.stages) / 1.05)
    stock = _search_stock(t, t.problem())
    smallest = min(stock.candidates, key=lambda c: max(sp.peak_memory for sp in c.stages))  # refitted
    runs = runner.runs
    assert len(runs) == 2 and runs[0] != runs[1] == smallest.notes[0]
    assert any(x.startswith("stock search: 1 configurations measured; stopped: every stock candidate")
               for x in t.log)
    assert stock.fits and stock.best["plan"]["notes"] == smallest.notes


def test_stock_search_probes_a_faster_configuration_predicted_just_over_the_budget():
    """The stock side gets the tuned plans' memory probe: after the search, the fastest stock configuration
    the model puts over the budget's limit but within ``MEMORY_PROBE`` of the budget is measured when it
    is predicted faster than the best measured; measured within the limit and faster, it is the baseline.
    With no configuration predicted in that band, nothing more is measured."""
    from deepspeed_ppq.autotune.loop import MEMORY_PROBE, _search_stock, _Tuning
    from deepspeed_ppq.autotune.runner import TrialResult
    from deepspeed_ppq.config import AutotuneConfig

    # 8-bit Adam clearly slower here: the one-stage fp32 configurations are the fastest, and the largest
    cuts, profile, cands, predicted = _stock_profile(2e-7)
    tol = AutotuneConfig().memory_tolerance

    def peak(c) -> float:
        return max(sp.peak_memory for sp in c.stages)

    def search(budget: int):
        """Configurations the model puts over the limit measure 10% under their prediction and 10% faster;
        the others as predicted. The phases measured as predicted (the step's below them) leave the
        memory model as it is."""
        def trial(plan):
            pred = predicted[plan.notes[0]]
            f = 0.9 if max(sum(m.values()) for m in pred) > budget * (1 + tol) else 1.0
            t = f * plan.predicted_step_time
            return TrialResult([t, t, t], 1, 1.0, _measured(pred, f, step_total=0))

        runner = _StockRunner(cuts, trial)
        settings = AutotuneConfig(ab_repeats=0, stock_trials=1, stock_margin=0.0, memory_budget=budget)
        t = _Tuning(runner, settings, global_batch=8, profile=profile)
        return runner.runs, _search_stock(t, t.problem())

    # the fastest configuration 8% over the budget: over the 5% limit, within the 10% probe
    runs, stock = search(int(peak(cands[0]) / (1 + 0.8 * MEMORY_PROBE)))
    limit, band = stock.problem.memory_budget * (1 + tol), stock.problem.memory_budget * (1 + MEMORY_PROBE)
    first = next(m for m in stock.measured if m["plan"]["notes"][0] == runs[0])["run"]["measured_step_time"]
    want = next(c for c in stock.candidates if c.notes[0] != runs[0] and limit < peak(c) <= band)
    assert want.predicted_step_time < first and runs == [runs[0], want.notes[0]]
    assert stock.best["plan"]["notes"][0] == want.notes[0]  # measured within the limit, and faster
    # a budget with no configuration predicted between its limit and the probe's
    peaks = sorted({peak(c) for c in cands})
    gap = next(a for a, b in zip(peaks, peaks[1:]) if b > a * (1 + MEMORY_PROBE) / (1 + tol))
    runs, stock = search(int(gap / (1 + tol)) + 1)
    assert len(runs) == 1 and stock.best["plan"]["notes"][0] == runs[0]


def test_memory_probe_measures_a_plan_predicted_just_over_the_budget():
    """After a plan is accepted, the best plan under a budget ``MEMORY_PROBE`` wider is measured when the
    model predicts it faster: it replaces the accepted plan when its measured peak fits the user's
    budget and it runs faster; measured over the budget, the accepted plan stays. With no faster plan
    in the wider budget nothing is measured."""
    from types import SimpleNamespace

    from deepspeed_ppq.autotune.loop import (
        MEMORY_PROBE,
        _make_gate,
        _memory_probe,
        _Tuning,
        same_configuration,
    )
    from deepspeed_ppq.config import AutotuneConfig

    free = plan_pipeline(_problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[1, 2]))
    peak = max(st.peak_memory for st in free.stages)
    budget = int(peak / (1 + MEMORY_PROBE / 2))  # the unconstrained plan is predicted ~5% over it
    prob = _problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[1, 2], memory_budget=budget)
    accepted = plan_pipeline(prob)
    assert accepted.predicted_step_time > free.predicted_step_time  # the budget costs the model time

    def tuning(measured_peak: float, step_time: float) -> tuple[_Tuning, list]:
        t = _Tuning(SimpleNamespace(log=lambda msg: None),
                    AutotuneConfig(memory_budget=budget, memory_tolerance=0.0), global_batch=8)
        t.profile = SimpleNamespace(threads_per_rank=1)
        measured = []

        def measure(problem, plan, quality=False):
            measured.append(plan)
            run = {"measured_step_time": step_time, "peak_memory": measured_peak, "val_loss": 1.0}
            return run, ([] if measured_peak <= budget else [f"stage 0 peak {measured_peak} > {budget}"])

        t.measure, t.quality = measure, lambda plan, seed: 1.0
        return t, measured

    gate = _make_gate([1.0], 0.01)
    run = {"measured_step_time": 0.200, "peak_memory": 0.9 * budget, "val_loss": 1.0}
    for measured_peak, replaced in ((0.98 * budget, True), (1.03 * budget, False)):
        t, measured = tuning(measured_peak, 0.150)
        iterations = [{"iteration": 0, "accepted": True}]
        plan, _ = _memory_probe(t, prob, (accepted, run), gate, iterations)
        assert len(measured) == 1 and same_configuration(measured[0], free)
        assert (plan is measured[0]) == replaced and iterations[-1]["memory_probe"]
        assert plan.memory_budget == budget  # the user's budget, not the wider one it was planned at
        assert iterations[0]["accepted"] != replaced and iterations[-1]["accepted"] == replaced
        assert t.log[-1].startswith("memory probe (predicted over the budget)")
    t, measured = tuning(0.5 * budget, 0.150)  # the unconstrained plan accepted: nothing faster to probe
    assert _memory_probe(t, prob, (free, run), gate, [])[0] is free and not measured


def test_a_hold_back_that_leaves_no_plan_plans_at_the_smallest():
    """A plan measured far over its budget makes the loop hold back what the recalibrated model still
    misses; when that leaves no plan, the loop plans at the smallest budget the model has (the most
    frugal plan, the likeliest to fit) instead of failing, and that plan, measured within the budget,
    is accepted. With no plan measured yet, an infeasible budget is the user's error as before."""
    from types import SimpleNamespace

    from deepspeed_ppq.autotune.loop import _make_gate, _plan_and_measure, _Tuning
    from deepspeed_ppq.config import AutotuneConfig

    free = plan_pipeline(_problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[1, 2]))
    budget = int(max(st.peak_memory for st in free.stages))
    prob = _problem(4, 8, world_size=2, global_batch=8, pipeline_degrees=[1, 2], memory_budget=budget)
    with pytest.raises(InfeasibleBudgetError) as small:
        plan_pipeline(dataclasses.replace(prob, memory_budget=1))
    need = small.value.need
    assert 0 < need < budget

    t = _Tuning(SimpleNamespace(log=lambda msg: None),
                AutotuneConfig(memory_budget=budget, memory_tolerance=0.0, max_iterations=3), global_batch=8)
    t.profile = SimpleNamespace(threads_per_rank=1)
    measured = []

    def measure(problem, plan, quality=False):
        measured.append((plan, problem.memory_budget))
        total = 3 * budget if len(measured) == 1 else need  # the first plan far over, the next within
        stages = [{"measured_memory": {"total": total, "phases": {"pipeline": {"activations": 0}}}}
                  for _ in plan.stages]
        run = {"measured_step_time": 0.1, "peak_memory": total, "val_loss": 1.0, "stages": stages}
        return run, ([f"stage 0 peak {total} > {budget}"] if total > budget else [])

    t.measure = measure
    iterations, accepted = _plan_and_measure(t, prob, _make_gate([1.0], 0.01))
    assert len(measured) == 2 and iterations[0]["over_budget"] and not iterations[1]["over_budget"]
    assert measured[1][1] == math.ceil(need) and accepted[0] is measured[1][0]
    assert max(st.peak_memory for st in accepted[0].stages) <= math.ceil(need)
    assert accepted[0].memory_budget == budget  # the user's budget, not the one held back
    assert any("leaves no plan; planning at the smallest the model has" in line for line in t.log)


def test_excluding_every_schedule_is_an_infeasible_plan_not_a_crash():
    """A runner-up asked of a problem with a single schedule (one pipeline degree, one micro-batch size)
    has nothing left to plan: ``plan_pipeline`` says so with InfeasibleBudgetError, which the tuning loop
    takes as "no runner-up"."""
    prob = _problem(4, 6, world_size=2, global_batch=8, pipeline_degrees=[2], micro_batch_sizes=[2])
    best = plan_pipeline(prob)
    with pytest.raises(InfeasibleBudgetError, match=r"every \(pipeline degree, micro-batch size\) pair"):
        plan_pipeline(prob, exclude=frozenset({(best.pipeline_degree, best.micro_batch_size)}))
