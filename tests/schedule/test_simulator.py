"""The simulator against closed forms: bubble fractions, GPipe vs 1F1B memory, interleaving, ZB-H1,
communication changing rankings, codec time, recomputation and the memory model."""

import pytest

from deepspeed_ppq.schedule import (
    LinkModel,
    StageCost,
    StageMemory,
    build_schedule,
    simulate,
    split_costs,
)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8), (4, 16), (8, 8), (5, 13)])
@pytest.mark.parametrize("name", ["1f1b", "deepspeed", "gpipe"])
def test_equal_stages_free_comm_bubble_is_closed_form(name, p, m):
    f, b = 0.3, 0.7
    r = simulate(build_schedule(name, p, m), [StageCost(f, b)] * p)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.step_time == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p, m", [(4, 8), (6, 4), (3, 9)])
def test_gpipe_same_time_as_1f1b_but_holds_all_microbatches(p, m):
    act = 1000
    mem = [StageMemory({"weights.fp32": 10}, activation_per_microbatch=act)] * p
    g = simulate(build_schedule("gpipe", p, m), [StageCost(1.0, 2.0)] * p, memory=mem)
    o = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 2.0)] * p, memory=mem)
    assert g.step_time == pytest.approx(o.step_time)
    for s in range(p):
        assert g.per_stage[s].peak_inflight == m
        assert g.per_stage[s].peak_memory["activations"] == m * act
        assert o.per_stage[s].peak_inflight == min(p - s, m)
        assert o.per_stage[s].peak_memory["activations"] == min(p - s, m) * act
        assert o.per_stage[s].peak_total == 10 + min(p - s, m) * act


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 8, 4), (2, 4, 3), (8, 16, 2)])
def test_interleaving_divides_bubble_by_v(p, m, v):
    f, b = 1.0, 2.0
    base = simulate(build_schedule("1f1b", p, m), [StageCost(f, b)] * p)
    sched = build_schedule("interleaved", p, m, v)
    inter = simulate(sched, split_costs([StageCost(f, b)] * p, sched))
    busy = m * (f + b)
    assert base.step_time - busy == pytest.approx((p - 1) * (f + b))
    assert inter.step_time - busy == pytest.approx((base.step_time - busy) / v)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 12), (8, 16)])
def test_zbh1_bubble_below_1f1b_at_equal_memory(p, m):
    f, bi, bw = 1.0, 1.0, 1.0
    act, w_in = 100, 5
    mem = [StageMemory(activation_per_microbatch=act, weight_grad_inputs=w_in)] * p
    one = simulate(build_schedule("1f1b", p, m), [StageCost(f, bi, bw)] * p, memory=mem)
    zb = simulate(build_schedule("zbh1", p, m), [StageCost(f, bi, bw)] * p, memory=mem)
    assert zb.bubble_fraction < one.bubble_fraction
    # The paper's ZB-H1 bubble: (p - 1) * (F + B - W) against 1F1B's (p - 1) * (F + B + W).
    assert one.step_time - m * (f + bi + bw) == pytest.approx((p - 1) * (f + bi + bw))
    assert zb.step_time - m * (f + bi + bw) == pytest.approx((p - 1) * (f + bi - bw))
    for s in range(p):
        # Same micro-batches in flight between F and B; pending Ws keep only their small inputs.
        assert zb.per_stage[s].peak_inflight == one.per_stage[s].peak_inflight == p - s
        assert one.per_stage[s].peak_memory["activations"] == (p - s) * act
        assert zb.per_stage[s].peak_memory["activations"] <= (p - s) * act + s * w_in


def test_free_comm_ranks_interleaved_first_slow_link_reverses_it():
    """Interleaving halves the bubble but doubles the transfers: on a slow blocking link it loses."""
    p, m, v = 4, 8, 2
    per_rank = [StageCost(1e-3, 2e-3)] * p
    sched_i = build_schedule("interleaved", p, m, v)
    sched_o = build_schedule("1f1b", p, m)
    nbytes = 8 << 20
    costs_i = split_costs(per_rank, sched_i)
    for link, interleaved_wins in [(None, True), (LinkModel(5e-6, 400e9, overlap=False), True),
                                   (LinkModel(50e-6, 1e9, overlap=False), False)]:
        ti = simulate(sched_i, costs_i, [(nbytes, nbytes)] * (p * v - 1), link).step_time
        to = simulate(sched_o, per_rank, [(nbytes, nbytes)] * (p - 1), link).step_time
        assert (ti < to) == interleaved_wins, (link, ti, to)


def test_chimera_advantage_fades_with_slow_links():
    """Chimera beats 1F1B at few micro-batches on free links; its bidirectional traffic hurts it more."""
    p, m = 4, 4
    costs = [StageCost(1e-3, 2e-3)] * p
    ch, one = build_schedule("chimera", p, m), build_schedule("1f1b", p, m)
    free_gain = simulate(one, costs).step_time / simulate(ch, costs).step_time
    assert free_gain > 1.1
    link = LinkModel(1e-4, 2e9, overlap=False)
    bb = [(4 << 20, 4 << 20)] * (p - 1)
    slow_gain = simulate(one, costs, bb, link).step_time / simulate(ch, costs, bb, link).step_time
    assert slow_gain < free_gain


def test_link_time_codec_time_and_overrides():
    p, m = 2, 1
    costs = [StageCost(1.0, 2.0)] * 2
    # One micro-batch: F0, transfer act, F1, B1, transfer grad, B0.
    link = LinkModel(latency_s=0.1, bandwidth_Bps=100.0)
    r = simulate(build_schedule("1f1b", p, m), costs, [(50, 20)], link)
    assert r.step_time == pytest.approx(1 + 0.6 + 1 + 2 + 0.3 + 2)
    assert r.per_stage[0].comm == pytest.approx(0.6) and r.per_stage[1].comm == pytest.approx(0.3)
    slow = LinkModel(0.1, 100.0, overrides={(1, 0): (1.0, 10.0)})
    r2 = simulate(build_schedule("1f1b", p, m), costs, [(50, 20)], slow)
    assert r2.step_time == pytest.approx(1 + 0.6 + 1 + 2 + (1.0 + 2.0) + 2)
    # Codec: (act total, grad total), half on each side.
    r3 = simulate(build_schedule("1f1b", p, m), costs, [(50, 20)], link, codec_time=[(0.4, 0.2)])
    assert r3.step_time == pytest.approx(r.step_time + 0.4 + 0.2)
    assert r3.per_stage[0].busy == pytest.approx(1 + 2 + 0.2 + 0.1)


def test_overlap_hides_transfers_blocking_does_not():
    p, m = 2, 8
    costs = [StageCost(1.0, 1.0)] * p
    bb = [(40, 40)]
    over = simulate(build_schedule("1f1b", p, m), costs, bb, LinkModel(0, 100.0, overlap=True))
    block = simulate(build_schedule("1f1b", p, m), costs, bb, LinkModel(0, 100.0, overlap=False))
    assert block.step_time > over.step_time
    assert block.per_stage[0].comm_blocked == pytest.approx(m * 0.4)
    assert over.per_stage[0].comm_blocked == 0.0
    for s in block.per_stage:
        assert s.busy + s.comm_blocked + s.idle == pytest.approx(block.step_time)


def test_recomputation_trades_time_for_activation_memory():
    p, m = 4, 8
    plain = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 2.0)] * p,
                     memory=[StageMemory(activation_per_microbatch=1000)] * p)
    recomp = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 2.0, recompute=1.0)] * p,
                      memory=[StageMemory(activation_per_microbatch=100)] * p)
    assert recomp.step_time == pytest.approx((m + p - 1) * 4.0)
    peak = plain.per_stage[0].peak_memory["activations"]
    assert recomp.per_stage[0].peak_memory["activations"] == peak // 10


def test_memory_categories_and_timeline():
    p, m = 2, 4
    mem = [StageMemory({"weights.int4": 100, "weights.fp32": 50, "gradients": 400, "master_weights": 400,
                        "optimizer": 800}, activation_per_microbatch=30, comm_buffers=7,
                       feedback_buffers=11)] * p
    r = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 1.0)] * p, memory=mem)
    pk = r.per_stage[0].peak_memory
    assert pk == {"weights.int4": 100, "weights.fp32": 50, "gradients": 400, "master_weights": 400,
                  "optimizer": 800, "comm_buffers": 7, "feedback_buffers": 11, "activations": 60}
    tl = r.per_stage[0].memory_timeline
    assert tl[-1][1] == 0 and max(b for _, b in tl) == 60
    assert [t for t, _ in tl] == sorted(t for t, _ in tl)


def test_optimizer_time_is_added_at_the_end():
    r = simulate(build_schedule("1f1b", 2, 2), [StageCost(1.0, 1.0, optimizer=0.5), StageCost(1.0, 1.0)])
    assert r.step_time == pytest.approx(3 * 2 + 0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(costs=[StageCost(1, 1)] * 3), "costs has 3 entries: give one per model piece"),
    (dict(boundary_bytes=[(1, 1)] * 3), "boundary_bytes has 3 entries"),
    (dict(memory=[StageMemory()] * 3), "memory has 3 entries"),
    (dict(codec_time=[(1.0, 2.0, 3.0)]), r"codec_time\[0\]=\(1.0, 2.0, 3.0\) must have 2 or 4 entries"),
])
def test_bad_simulate_inputs_are_named(kwargs, match):
    args = dict(costs=[StageCost(1, 1)] * 2, boundary_bytes=[(1, 1)])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 2, 2), **args)


def test_bad_link_is_rejected():
    with pytest.raises(ValueError, match="bandwidth_Bps=0 must be > 0"):
        LinkModel(0.0, 0)
    with pytest.raises(ValueError, match="latency_s=-1 must be >= 0"):
        LinkModel(-1, 1.0)
