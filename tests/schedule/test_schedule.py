"""Schedules as data: notation, CSV round trip, builders against their papers and DeepSpeed, golden
files, bad input and deadlock detection."""

from pathlib import Path

import pytest

from deepspeed_ppq.schedule import (
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    dump_schedule_csv,
    load_schedule_csv,
    parse_action,
    validate_schedule,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("chimera", 1), ("deepspeed", 1)]


@pytest.mark.parametrize("text, action", [("1F0", Action(1, "F", 0)), ("12B31", Action(12, "B", 31)),
                                          ("0W3", Action(0, "W", 3)), ("3F4c1", Action(3, "F", 4, 1))])
def test_action_prints_and_parses_back(text, action):
    assert parse_action(text) == action
    assert str(action) == text


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "1F0c", "a1F0", "1 F0"])
def test_malformed_action_is_rejected(bad):
    with pytest.raises(ScheduleError, match="malformed"):
        parse_action(bad)


@pytest.mark.parametrize("name, v", ALL)
@pytest.mark.parametrize("p, m", [(2, 2), (2, 6), (4, 4), (4, 8), (6, 12)])
def test_builders_are_valid_and_round_trip_through_csv(name, v, p, m):
    s = build_schedule(name, p, m, v)
    validate_schedule(s)
    back = load_schedule_csv(dump_schedule_csv(s))
    assert back == s


@pytest.mark.parametrize("name, v", ALL)
def test_golden_schedules_unchanged(name, v):
    # Regenerate with the command in tests/golden/README.md after an intended change.
    golden = load_schedule_csv(GOLDEN / f"{name}_p4_m8.csv")
    assert build_schedule(name, 4, 8, v) == golden


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_deepspeed_order_matches_deepspeed_train_schedule(p, m):
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    ours = build_schedule("deepspeed", p, m)
    for s in range(p):
        seq = []
        for cmds in ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s):
            seq += [("F" if isinstance(c, ds.ForwardPass) else "B") for c in cmds
                    if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        assert seq == [a.kind for a in ours.actions[s]]


def test_1f1b_is_deepspeed_order():
    for p, m in [(2, 4), (4, 8), (3, 7)]:
        a, b = build_schedule("1f1b", p, m), build_schedule("deepspeed", p, m)
        assert a.actions == b.actions


@pytest.mark.parametrize("name, p, m, v, match", [
    ("interleaved", 4, 6, 2, "num_microbatches=6 must be a multiple of num_stages=4"),
    ("interleaved", 4, 8, 1, "virtual_stages=1 must be >= 2"),
    ("1f1b", 4, 0, 1, "num_microbatches=0 must be a positive integer"),
    ("1f1b", 0, 4, 1, "num_stages=0 must be a positive integer"),
    ("1f1b", 4, 8, 2, "virtual_stages=2 is only supported by 'interleaved'"),
    ("chimera", 3, 4, 1, "num_stages=3 and num_microbatches=4 must both be even"),
    ("pipedream", 4, 8, 1, "schedule 'pipedream' is unknown"),
])
def test_impossible_requests_are_rejected(name, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(name, p, m, v)


def _swap(s: Schedule, rank: int, i: int, j: int) -> Schedule:
    rows = [list(r) for r in s.actions]
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    return Schedule("broken", s.num_ranks, s.num_microbatches, tuple(map(tuple, rows)))


def test_hand_broken_schedule_deadlock_is_caught_with_marked_grid():
    s = build_schedule("1f1b", 4, 8)
    # Rank 3 (last) runs B0 before F0: waits for its own forward, which comes after it.
    broken = _swap(s, 3, 0, 1)
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate_schedule(broken)
    assert ">>3B0<<" in str(e.value) and "waits at 3B0 (index 0) for 3F0, which comes later" in str(e.value)
    # A cross-rank cycle: rank 0 waits for B0 before sending F1..F3, rank 1 needs F1 before its B0.
    rows = [list(r) for r in s.actions]
    rows[0] = [Action(0, "F", 0), Action(0, "B", 0)] + [a for a in rows[0] if a not in
                                                          (Action(0, "F", 0), Action(0, "B", 0))]
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate_schedule(Schedule("cycle", 4, 8, tuple(map(tuple, rows))))
    assert ">>" in str(e.value) and "rank |" in str(e.value)


def test_missing_duplicate_and_misplaced_actions_are_named():
    s = build_schedule("1f1b", 2, 2)
    rows = [list(r) for r in s.actions]
    with pytest.raises(ScheduleError, match="never runs B of micro-batch 1 on rank 0"):
        validate_schedule(Schedule("x", 2, 2, (tuple(rows[0][:-1]), tuple(rows[1]))))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_schedule(Schedule("x", 2, 2, (tuple(rows[0] + rows[0][:1]), tuple(rows[1]))))
    with pytest.raises(ScheduleError, match="names stage 1"):
        validate_schedule(Schedule("x", 2, 2, (tuple(rows[1]), tuple(rows[1]))))
    with pytest.raises(ScheduleError, match="micro-batch 5 is outside 0..1"):
        validate_schedule(Schedule("x", 2, 2, ((Action(0, "F", 5),), tuple(rows[1]))))


@pytest.mark.parametrize("text, match", [
    ("0,0F0,0B0\n2,1F0,1B0\n", "first cell must be the rank 1"),
    ("0,0F0,0Q0\n", "line 1: action '0Q0' is malformed"),
    ("0,0F0,1B0\n", "names stage 1 in the row of rank 0"),
    ("# ranks=3\n0,0F0,0B0\n", "header ranks=3 but the CSV has 1 rank rows"),
    ("# ranks=two\n0,0F0,0B0\n", "header ranks='two' must be a positive integer"),
    ("# placement=ring\n0,0F0,0B0\n", "placement='ring' is unknown"),
    ("# bogus\n0,0F0\n", "header item 'bogus' is not key=value"),
])
def test_malformed_csv_is_rejected(text, match):
    with pytest.raises(ScheduleError, match=match):
        load_schedule_csv(text)


def test_custom_csv_without_header_runs(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("0,0F0,0F1,0B0,0B1\n1,1F0,1B0,1F1,1B1\n")
    s = load_schedule_csv(path)
    assert (s.num_ranks, s.num_microbatches, s.name) == (2, 2, "custom")
    validate_schedule(s)
