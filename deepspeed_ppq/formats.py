"""Low-bit weight formats: one row per format, the one place their facts live.

Every layer reads this table: the config's ``WeightFormat`` (its members are the rows' names), the
reference kernels (``quant.ops``, ``quant.sr_ops``), the quantized weight and its exact bytes
(``quant.formats``), the precision policy, master-free training, the memory ledger, the simulator's
roofline (``schedule.costs``), the planner (``autotune``), and the C++ and CUDA kernels through
``csrc/common/formats.h``, which is generated from this table::

    python -m deepspeed_ppq.formats > csrc/common/formats.h

Adding a format is one ``FormatSpec`` row here, the header regenerated, and the kernels' cases: the
reference's branch in ``quant/ops.py`` (and ``quant/sr_ops.py`` with ``stochastic_rounding``), the
``switch`` cases in ``csrc/cpu/weights.cpp`` and ``csrc/cuda/weights.cu``. ``tests/test_format_table.py``
walks the table and checks that every layer agrees with it, the header and the kernels' accepted
names included.

This module imports nothing of the package and no torch (dtypes are named by their ``torch`` name), so
the planner and the simulator read it without loading the kernels.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FormatSpec",
    "FORMATS",
    "WEIGHT_FORMATS",
    "SR_FORMATS",
    "MASTER_FREE_FORMATS",
    "GRAD_DTYPE_BYTES",
    "format_spec",
    "cpp_header",
]


@dataclass(frozen=True)
class FormatSpec:
    """One low-bit weight format (blockwise: one scale per block of values, or per tensor).

    Attributes:
        name: what configs, ops and plans call it (``"int8"``).
        code: the integer the C++ and CUDA kernels use for it (``ppq::formats::Fmt``).
        cpp_name: its enumerator in ``ppq::formats::Fmt`` (``"I8"``).
        bits: bits per stored value; a 4-bit format packs two values per byte, the first in the high
            nibble (bitsandbytes' order).
        kind: how a code stands for a value: ``"int"`` (a signed integer grid ``-qmax..qmax``; packed
            formats store ``q + qmax + 1``), ``"codebook"`` (an index into ``code_map``) or ``"fp8"``
            (an fp8 number).
        qmax: ``Q``: the stored scale is ``absmax / Q``, and ``Q`` is the largest magnitude a code stands
            for.
        code_dtype: the ``torch`` dtype of the code tensor, by name (``torch.<code_dtype>``).
        per_tensor_scale: may keep one scale for the whole tensor (``weights.fp8_scale="tensor"``)
            instead of one per block.
        stochastic_rounding: has a stochastic-rounding quantizer (``ppq::weight_quantize_sr_out``).
        master_free: its codes may be the only copy of a trained weight (``weights.master="none"``);
            needs ``stochastic_rounding``.
        code_map: ``kind="codebook"``: the value of each code, as fp32 literals.
        max_code: ``kind="fp8"``: the largest finite code of magnitude at most ``qmax`` (the upper
            neighbour stochastic rounding never passes).
    """

    name: str
    code: int
    cpp_name: str
    bits: int
    kind: Literal["int", "codebook", "fp8"]
    qmax: float
    code_dtype: str
    per_tensor_scale: bool = False
    stochastic_rounding: bool = False
    master_free: bool = False
    code_map: tuple[float, ...] | None = None
    max_code: int | None = None

    @property
    def packed(self) -> bool:
        """Several values per byte of codes (4-bit formats: two)."""
        return self.bits < 8

    def code_elements(self, n: int) -> int:
        """Elements (bytes) of the code tensor that holds ``n`` values."""
        return -(-n * self.bits // 8)


# The QLoRA NF4 codebook, the same fp32 literals as bitsandbytes.functional.get_4bit_type("nf4").
_NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

FORMATS: tuple[FormatSpec, ...] = (
    FormatSpec("int8", 0, "I8", 8, "int", 127.0, "int8", stochastic_rounding=True, master_free=True),
    FormatSpec("int4", 1, "I4", 4, "int", 7.0, "uint8"),
    FormatSpec("nf4", 2, "NF4", 4, "codebook", 1.0, "uint8", code_map=_NF4_CODE),
    FormatSpec("fp8_e4m3", 3, "E4M3", 8, "fp8", 448.0, "float8_e4m3fn", per_tensor_scale=True,
               stochastic_rounding=True, master_free=True, max_code=0x7E),
    FormatSpec("fp8_e5m2", 4, "E5M2", 8, "fp8", 57344.0, "float8_e5m2", per_tensor_scale=True,
               stochastic_rounding=True, master_free=True, max_code=0x7B),
)
"""Every low-bit weight format, in ``code`` order."""

_BY_NAME = {s.name: s for s in FORMATS}

WEIGHT_FORMATS: tuple[str, ...] = tuple(s.name for s in FORMATS)
"""The names of the low-bit weight formats."""
SR_FORMATS: tuple[str, ...] = tuple(s.name for s in FORMATS if s.stochastic_rounding)
"""Formats with a stochastic-rounding quantizer."""
MASTER_FREE_FORMATS: tuple[str, ...] = tuple(s.name for s in FORMATS if s.master_free)
"""Formats whose codes can be the only copy of a trained weight (``weights.master="none"``)."""
GRAD_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}
"""Bytes per value of a master-free weight's gradient buffer, by ``weights.grad_dtype``."""


def _check_table() -> None:
    for i, s in enumerate(FORMATS):
        if s.code != i:
            raise ValueError(f"format {s.name}: code {s.code}, but it is row {i} (codes are row numbers)")
        if s.master_free and not s.stochastic_rounding:
            raise ValueError(f"format {s.name}: master_free needs stochastic_rounding")
        codebook, fp8 = s.kind == "codebook", s.kind == "fp8"
        if codebook != (s.code_map is not None) or fp8 != (s.max_code is not None):
            raise ValueError(f"format {s.name}: code_map is for codebooks, max_code for fp8")
        if 8 % s.bits:
            raise ValueError(f"format {s.name}: bits={s.bits} does not divide a byte")


_check_table()


def format_spec(fmt) -> FormatSpec:
    """The row of a low-bit weight format, by name (or a ``WeightFormat``).

    Raises:
        ValueError: ``fmt`` is no low-bit weight format (``"none"`` included); the message lists them.
    """
    spec = _BY_NAME.get(getattr(fmt, "value", fmt))
    if spec is None:
        raise ValueError(f"fmt={getattr(fmt, 'value', fmt)!r} is not a low-bit weight format: use one of "
                         f"{', '.join(WEIGHT_FORMATS)}")
    return spec


# ---------------------------------------------------------------------------------------------
# csrc/common/formats.h, generated from the table
# ---------------------------------------------------------------------------------------------
def _names(specs) -> str:
    names = [s.name for s in specs]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _cpp(x) -> str:
    """A C++ literal of a table value."""
    if isinstance(x, bool):
        return "true" if x else "false"
    return f"{x!r}f" if isinstance(x, float) else str(x)


# The columns of the header's Row: (C++ type, field, value of a table row, comment).
_ROW = (
    ("int", "bits", lambda s: s.bits, "bits per stored value"),
    ("float", "qmax", lambda s: s.qmax, "Q: the stored scale is absmax / Q; the largest magnitude of a code"),
    ("bool", "packed4", lambda s: s.bits == 4, "two 4-bit codes per byte, the first in the high nibble"),
    ("bool", "is_fp8", lambda s: s.kind == "fp8", "codes are fp8 numbers"),
    ("bool", "per_tensor_scale", lambda s: s.per_tensor_scale, "may keep one scale for the whole tensor"),
    ("bool", "has_sr", lambda s: s.stochastic_rounding, "has a stochastic-rounding quantizer"),
    ("int", "max_code", lambda s: s.max_code or 0, "fp8: the largest finite code <= qmax (0 otherwise)"),
)


def cpp_header() -> str:
    """The text of ``csrc/common/formats.h``: the table for the C++ and CUDA kernels."""
    enum = ", ".join(f"{s.cpp_name} = {s.code}" for s in FORMATS)
    out = [
        "// Low-bit weight formats for the C++ CPU kernels and the CUDA kernels: one row per format.",
        "// Generated from deepspeed_ppq/formats.py (the table) by",
        "//   python -m deepspeed_ppq.formats > csrc/common/formats.h",
        "// Do not edit by hand: tests/test_format_table.py checks this file against the table.",
        "// Plain C++17 with no torch header, so nvcc compiles it; the helpers run on host and device.",
        "#pragma once",
        "",
        "#include <string_view>",
        "",
        "#if defined(__CUDACC__)",
        "#define PPQ_FMT_HD __host__ __device__",
        "#else",
        "#define PPQ_FMT_HD",
        "#endif",
        "",
        "namespace ppq::formats {",
        "",
        "// The integer code of each format: what the kernels switch on and the CUDA entry points take.",
        f"enum class Fmt : int {{ {enum} }};",
        "",
        f"inline constexpr int kNumFormats = {len(FORMATS)};",
        "",
        "// Names, in code order, and the lists error messages offer.",
        "inline constexpr std::string_view kNames[kNumFormats] = {"
        + ", ".join(f'"{s.name}"' for s in FORMATS) + "};",
        f'inline constexpr const char* kAllowed = "{_names(FORMATS)}";',
        f'inline constexpr const char* kAllowedSR = "{_names(s for s in FORMATS if s.stochastic_rounding)}";',
        "",
        "// The format called `name`, or false (and `out` untouched) when no format has that name.",
        "inline bool parse(std::string_view name, Fmt* out) {",
        "  for (int i = 0; i < kNumFormats; ++i) {",
        "    if (kNames[i] == name) {",
        "      *out = static_cast<Fmt>(i);",
        "      return true;",
        "    }",
        "  }",
        "  return false;",
        "}",
        "",
    ]
    out += ["// One row per format, as the table's.", "struct Row {"]
    out += [f"  {t} {f};  // {doc}" for t, f, _, doc in _ROW] + ["};", ""]
    out += ["PPQ_FMT_HD constexpr Row row(Fmt f) {", "  switch (f) {"]
    out += [f"    case Fmt::{s.cpp_name}: return {{{', '.join(_cpp(v(s)) for _, _, v, _ in _ROW)}}};"
            for s in FORMATS]
    out += ["  }", "  return {};", "}", ""]
    out += [f"PPQ_FMT_HD constexpr {t} {f}(Fmt f) {{ return row(f).{f}; }}" for t, f, _, _ in _ROW] + [""]
    out += ["}  // namespace ppq::formats", ""]
    for s in FORMATS:
        if s.code_map is not None:
            out += [f"// The codebook of {s.name}, in code order: initialise a table with "
                    f"`float t[{len(s.code_map)}] = {{PPQ_CODE_MAP_{s.cpp_name}}};`.",
                    f"#define PPQ_CODE_MAP_{s.cpp_name} \\"]
            vals = [_cpp(v) for v in s.code_map]
            rows = [", ".join(vals[i:i + 4]) for i in range(0, len(vals), 4)]
            out += [f"  {r}, \\" for r in rows[:-1]] + [f"  {rows[-1]}", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(cpp_header())
