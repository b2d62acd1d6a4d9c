"""Config fields validated when the config loads, and applied on the DeepSpeed path."""

from __future__ import annotations

import pytest
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.config import PPQConfigError, load_ppq_config


@pytest.mark.parametrize("section, field, value", [
    ({"autotune": {"micro_batch_sizes": [0, -2]}}, "ppq.autotune.micro_batch_sizes", "[0, -2]"),
    ({"partition": {"method": "type:(Block"}}, "ppq.partition", "type:(Block"),
    ({"autotune": {"schedules": ["zigzag"]}}, "ppq.autotune.schedules", "zigzag"),
])
def test_list_and_pattern_fields_fail_at_load(section, field, value):
    with pytest.raises(PPQConfigError) as info:
        load_ppq_config(section)
    msg = str(info.value)
    assert field in msg and value in msg, msg


@pytest.mark.distributed
def test_stock_json_and_optimizer_8bit(tmp_path):
    (res,) = run_ranks(ROOT / "tests" / "dist" / "ds_config_paths.py", 1, [tmp_path])
    assert res["stock_parts"] == [[0, 3], [0, 3]]
    assert res["optimizer"] == "AdamW8bit", res
    assert "torch.uint8" in res["state_dtypes"], res
    err = res["plain_error"]
    assert err.startswith("PPQConfigError") and "ppq.weights.optimizer_8bit=true" in err and "AdamW" in err
