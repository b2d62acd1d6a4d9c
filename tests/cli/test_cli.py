import json
import subprocess
import sys

import pytest

from deepspeed_ppq.cli import main


def test_report_lists_versions_and_native_status(capsys):
    assert main(["report", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in ("torch", "deepspeed", "megatron-core", "bitsandbytes", "transformer_engine", "gpu", "native"):
        assert key in rep
    status = rep["native"]["_C"]
    assert status == "loaded" or status.startswith(("skipped", "not available")), status


def test_schema_command_prints_json_schema(capsys):
    assert main(["schema"]) == 0
    assert "CodecConfig" in json.loads(capsys.readouterr().out)["$defs"]


def test_console_script_help():
    cmd = [sys.executable, "-m", "deepspeed_ppq.cli", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0 and "report" in out.stdout


def test_docstring_and_help_name_the_commands_that_exist(capsys):
    import deepspeed_ppq.cli as cli

    listed = cli.__doc__.split("``ppq ", 1)[1].split(" ...``", 1)[0].split(" | ")
    assert listed == list(cli._SUBCOMMANDS)  # no `ppq plan`: `ppq tune` writes the plan
    with pytest.raises(SystemExit):
        main(["--help"])
    description = capsys.readouterr().out.split("\n\n")[1]
    assert "plan," not in description and all(name in description for name in cli._SUBCOMMANDS)
