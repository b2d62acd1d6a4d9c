import json
import subprocess
import sys

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
