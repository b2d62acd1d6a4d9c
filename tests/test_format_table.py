"""The weight-format table (deepspeed_ppq.formats) against every layer that reads it.

One row per format; each check below walks the table and asks one layer what it knows of each row: the
config, the reference kernels, the quantized weight and its exact bytes, the planner's and the
simulator's lookups, the C++/CUDA header (parsed here, not trusted), and the C++ kernels' accepted names.
"""

import re
from pathlib import Path

import pytest
import torch

from deepspeed_ppq import formats
from deepspeed_ppq import ops as registry
from deepspeed_ppq.autotune import costs as autotune_costs
from deepspeed_ppq.config import WeightFormat, WeightsConfig
from deepspeed_ppq.formats import FORMATS, MASTER_FREE_FORMATS, SR_FORMATS, WEIGHT_FORMATS, format_spec
from deepspeed_ppq.quant import ops as wops
from deepspeed_ppq.quant import sr_ops
from deepspeed_ppq.quant.formats import quantize_weight, weight_storage_bytes
from deepspeed_ppq.quant.ledger import ParamSpec
from deepspeed_ppq.schedule.costs import FORMAT_BITS

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "common" / "formats.h"
REGENERATE = "python -m deepspeed_ppq.formats > csrc/common/formats.h"
native = pytest.mark.skipif(registry.native_status().get("_C") != "loaded",
                            reason="C++ extension not loaded; run `make build`")


def _header() -> str:
    return HEADER.read_text()


def _rows(text: str) -> dict[str, dict[str, str]]:
    """The header's ``struct Row`` fields and ``case Fmt::X: return {...};`` rows -> {X: {field: value}}."""
    struct = re.search(r"struct Row \{(.*?)\};", text, re.S)
    assert struct, "csrc/common/formats.h has no `struct Row`"
    fields = re.findall(r"^\s*\w+ (\w+);", struct.group(1), re.M)
    rows = re.findall(r"case Fmt::(\w+): return \{([^}]*)\};", text)
    return {name: dict(zip(fields, (v.strip() for v in values.split(",")))) for name, values in rows}


def test_header_is_generated_from_the_table():
    assert _header() == formats.cpp_header(), f"csrc/common/formats.h is stale: regenerate it: `{REGENERATE}`"


def test_header_codes_names_and_helpers_match_each_row():
    text = _header()
    enum = re.search(r"enum class Fmt : int \{([^}]*)\}", text)
    assert enum, "csrc/common/formats.h declares no `enum class Fmt : int { ... }`"
    codes = {k: int(v) for k, v in re.findall(r"(\w+) = (\d+)", enum.group(1))}
    names = re.findall(r'"(\w+)"', re.search(r"kNames\[kNumFormats\] = \{([^}]*)\}", text).group(1))
    rows = _rows(text)
    assert len(codes) == len(names) == len(rows) == len(FORMATS), (codes, names, list(rows))
    for s in FORMATS:
        where = f"format {s.name} (csrc/common/formats.h; `{REGENERATE}`)"
        assert codes.get(s.cpp_name) == s.code, f"{where}: Fmt::{s.cpp_name} = {codes.get(s.cpp_name)}"
        assert names[s.code] == s.name, f"{where}: kNames[{s.code}] = {names[s.code]!r}"
        row = rows[s.cpp_name]
        want = {"bits": s.bits, "qmax": s.qmax, "packed4": s.packed, "is_fp8": s.kind == "fp8",
                "per_tensor_scale": s.per_tensor_scale, "has_sr": s.stochastic_rounding,
                "max_code": s.max_code or 0}
        got = {"bits": int(row["bits"]), "qmax": float(row["qmax"].rstrip("f")),
               "max_code": int(row["max_code"]),
               **{k: row[k] == "true" for k in ("packed4", "is_fp8", "per_tensor_scale", "has_sr")}}
        assert got == want, f"{where}: row {got}, table {want}"


def test_python_lookups_read_the_table():
    assert [f.value for f in WeightFormat] == ["none", *WEIGHT_FORMATS]
    assert wops.WEIGHT_FORMATS == WEIGHT_FORMATS and sr_ops.SR_FORMATS == SR_FORMATS
    assert autotune_costs.MASTER_FREE_FORMATS == MASTER_FREE_FORMATS
    assert wops.NF4_CODE == format_spec("nf4").code_map
    for s in FORMATS:
        assert WeightFormat(s.name).bits == FORMAT_BITS[s.name] == s.bits, s.name
        assert wops.format_qmax(s.name) == s.qmax, s.name
        assert wops.code_dtype(s.name) == getattr(torch, s.code_dtype), s.name
        assert wops.codes_numel(s.name, 7) == (4 if s.packed else 7), s.name
        assert (s.name in SR_FORMATS) == s.stochastic_rounding, s.name
        assert (s.name in MASTER_FREE_FORMATS) == s.master_free, s.name


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.name)
def test_master_free_is_the_table_column_in_every_check(spec):
    def accepted(make) -> bool:
        try:
            make()
        except ValueError:
            return False
        return True

    assert accepted(lambda: WeightsConfig(format=spec.name, master="none")) == spec.master_free
    assert accepted(lambda: ParamSpec("w", (8, 8), spec.name, master="none")) == spec.master_free


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.name)
@pytest.mark.parametrize("scale_dtype,double_quant,fp8_scale",
                         [("fp32", False, "block"), ("bf16", False, "block"), ("fp32", True, "block"),
                          ("fp32", False, "tensor")])
def test_storage_bytes_from_the_shape_equal_the_weight(spec, scale_dtype, double_quant, fp8_scale):
    if fp8_scale == "tensor" and not spec.per_tensor_scale:
        with pytest.raises(ValueError, match="fp8_scale='tensor' is only for fp8 formats"):
            quantize_weight(torch.randn(3, 5), spec.name, fp8_scale="tensor")
        return
    w = torch.randn(37, 91)  # 3367 values: a partial last block, an odd count for packed formats
    qw = quantize_weight(w, spec.name, 64, scale_dtype, double_quant, fp8_scale)
    got = weight_storage_bytes(w.shape, spec.name, 64, scale_dtype, double_quant, fp8_scale)
    assert got["codes"] == qw.qdata.nbytes == spec.code_elements(w.numel())
    assert sum(got.values()) == qw.nbytes
    assert qw.qdata.dtype == getattr(torch, spec.code_dtype)


@native
@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.name)
def test_cpu_kernels_accept_exactly_the_table(spec):
    x = torch.randn(4, 64)
    codes, scales = torch.ops.ppq.weight_quantize(x, spec.name, 64, torch.float32, False)
    assert codes.dtype == getattr(torch, spec.code_dtype) and codes.numel() == spec.code_elements(x.numel())
    assert torch.equal(scales, x.abs().amax(dim=1) / spec.qmax)
    c = torch.empty(x.numel(), dtype=getattr(torch, spec.code_dtype))
    s = torch.empty(4)
    if spec.stochastic_rounding:
        torch.ops.ppq.weight_quantize_sr_out(x, spec.name, 64, 1, 0, c, s)
    else:
        with pytest.raises(RuntimeError, match=f"fmt='{spec.name}' has no stochastic-rounding quantizer: use "
                                               f"{', '.join(SR_FORMATS[:-1])} or {SR_FORMATS[-1]}"):
            torch.ops.ppq.weight_quantize_sr_out(x, spec.name, 64, 1, 0, c, s)


@native
def test_cpu_kernels_name_the_table_on_an_unknown_format():
    allowed = f"{', '.join(WEIGHT_FORMATS[:-1])} or {WEIGHT_FORMATS[-1]}"
    with pytest.raises(RuntimeError, match=f"fmt='int3' is not a weight format: use {allowed}"):
        torch.ops.ppq.weight_quantize(torch.randn(64), "int3", 64, torch.float32, False)
    with pytest.raises(ValueError, match=f"fmt='int3' is not a low-bit weight format: use one of "
                                         f"{', '.join(WEIGHT_FORMATS)}"):
        format_spec("int3")
