"""``ppq tune``'s own flags: the same before and after the script, checked before any rank starts.

``spawn_local`` (which starts the ranks, each running the script) is replaced by a recorder: what these
tests check is the command line the ranks would get and what a rank makes of it.
"""

from __future__ import annotations

import argparse

import pytest

from deepspeed_ppq.cli import main
from deepspeed_ppq.config import AutotuneConfig, load_ppq_config
from deepspeed_ppq.integrations import tune_cli


@pytest.fixture
def spawned(monkeypatch):
    """``(argv, nproc)`` of each start of local ranks."""
    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(tune_cli, "spawn_local", lambda argv, nproc: calls.append((argv, nproc)) or 0)
    return calls


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _rank_view(argv: list[str]) -> tuple[AutotuneConfig, list[str]]:
    """What a rank makes of its command line: (the tuner's settings, the script's arguments)."""
    parser = argparse.ArgumentParser(prog="ppq")
    tune_cli.add_parser(parser.add_subparsers())
    ns = parser.parse_args(argv)
    mine, script_args = tune_cli._tuner_args(ns)
    settings = tune_cli.flag_overrides(mine, ns.setting_names)
    return load_ppq_config({"autotune": settings}).autotune, script_args


@pytest.mark.parametrize("placement", ["before", "after"])
def test_tuner_flags_before_or_after_the_script_are_honoured(spawned, script, placement):
    flags = ["--budget-mb", "64", "--nproc", "3", "--seeds", "5"]
    argv = [*flags, script, "--foo"] if placement == "before" else [script, "--foo", *flags]
    assert main(["tune", *argv]) == 0
    [(rank_argv, nproc)] = spawned
    assert nproc == 3
    cfg, script_args = _rank_view(rank_argv)
    assert cfg.memory_budget == 64 * 2**20 and cfg.seeds == 5 and script_args == ["--foo"]


def test_script_flags_are_the_scripts_and_the_last_tuner_flag_wins(spawned, script):
    # --seed is the script's (not an abbreviation of --seeds); after the script, --seeds 5 wins over 3
    main(["tune", "--seeds", "3", script, "--seed", "7", "--seeds", "5", "--min-gradient-bits", "4"])
    cfg, script_args = _rank_view(spawned[0][0])
    assert script_args == ["--seed", "7"] and cfg.seeds == 5 and cfg.min_gradient_bits == 4


@pytest.mark.parametrize("flag, value, allowed", [
    ("--micro-batch-sizes", "a", "item 1: Input should be a valid integer"),
    ("--micro-batch-sizes", "1,,2", "item 2: Input should be a valid integer"),
    ("--budget-mb", "nan", "give a finite number of MiB"),
    ("--budget-mb", "inf", "give a finite number of MiB"),
    ("--budget-mb", "1e-9", "of at least one byte"),
    ("--memory-budget", "inf", "finite"),
    ("--seeds", "0", "greater than or equal to 1"),
    ("--nproc", "0", "give a positive integer"),
])
@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_bad_tuner_flags_are_refused_before_any_rank_starts(spawned, script, capsys, flag, value, allowed,
                                                            before):
    with pytest.raises(SystemExit) as exc:
        main(["tune", *([flag, value, script] if before else [script, flag, value])])
    assert exc.value.code == 2 and not spawned
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"ppq tune: error: argument {flag}: {value!r}") and allowed in error, error
