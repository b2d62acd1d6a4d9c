"""Precision policy: block detection, defaults, rule order, errors, explain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed_ppq.config import PrecisionRule, WeightsConfig
from deepspeed_ppq.quant import (
    PrecisionPolicy,
    QuantLinear,
    as_policy,
    block_index,
    convert_model,
    explain,
    plan,
    weight_storage_bytes,
)


class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


class _Net(nn.Module):
    """A named-blocks transformer skeleton: embed, blocks.N, final norm, head."""

    def __init__(self, n=5, d=16, tie=False, container="blocks"):
        super().__init__()
        self.embed = nn.Embedding(32, d)
        self.embed_proj = nn.Linear(d, d)
        setattr(self, container, nn.ModuleList(_Block(d) for _ in range(n)))
        self.final_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 32, bias=False)
        self.out = nn.Linear(d, 32, bias=False)
        if tie:
            self.out.weight = self.embed.weight


def _formats(model, policy, **kw):
    return {d.name: d.format.value for d in plan(model, policy, **kw)}


@pytest.mark.parametrize(
    "name,expect",
    [
        ("blocks.3.attn.qkv", 3),
        ("layers.3.mlp.fc", 3),
        ("h.3.attn", 3),
        ("transformer.h.12.mlp.c_fc", 12),
        ("decoder.layers.0.self_attention.linear_qkv", 0),
        ("lm_head", None),
        ("3.attn.qkv", None),
        ("hidden.3.x", None),
    ],
)
def test_block_index_from_names(name, expect):
    assert block_index(name) == expect


def test_block_index_pipeline_module_names():
    blocks = [1, 2, 3, 4]  # layer 0 embedding, 1..4 blocks, 5 head
    assert block_index("3.attn.qkv", blocks) == 2
    assert block_index("1.mlp.fc", blocks) == 0
    assert block_index("0.tok", blocks) is None and block_index("5.lm_head", blocks) is None


@pytest.mark.parametrize("container", ["blocks", "layers", "h"])
def test_defaults_keep_sensitive_layers_and_first_last_blocks(container):
    fm = _formats(_Net(container=container), WeightsConfig(format="int4"))
    c = container
    assert fm["embed_proj"] == fm["lm_head"] == "none"
    assert fm[f"{c}.0.qkv"] == fm[f"{c}.4.proj"] == "none"
    assert fm[f"{c}.1.qkv"] == fm[f"{c}.2.proj"] == fm[f"{c}.3.qkv"] == "int4"
    assert fm["out"] == "int4"  # an untied projection with an ordinary name is not special
    fm2 = _formats(
        _Net(container=container), WeightsConfig(format="int4", keep_first_blocks=2, keep_last_blocks=0)
    )
    assert fm2[f"{c}.1.qkv"] == "none" and fm2[f"{c}.4.qkv"] == "int4"


def test_tied_weight_stays_dense():
    d = {x.name: x for x in plan(_Net(tie=True), WeightsConfig(format="int8"))}
    assert d["out"].format.value == "none" and "shared" in d["out"].reason


def test_rules_first_match_wins_and_override_defaults():
    cfg = WeightsConfig(
        format="int8",
        rules=[
            PrecisionRule(pattern=r"blocks\.0\.qkv$", match="regex", format="nf4"),  # overrides keep-first
            PrecisionRule(pattern="blocks.*.proj", format="none"),
            PrecisionRule(pattern="blocks.*", format="fp8_e4m3"),  # shadowed for proj by the rule above
            PrecisionRule(pattern="*", module_type="Embedding", format="int4"),  # type must match too
        ],
    )
    d = {x.name: x for x in plan(_Net(), cfg)}
    assert d["blocks.0.qkv"].format.value == "nf4" and d["blocks.0.qkv"].reason.startswith("rule 0")
    assert d["blocks.2.proj"].format.value == "none" and d["blocks.2.proj"].reason.startswith("rule 1")
    assert d["blocks.2.qkv"].format.value == "fp8_e4m3"
    assert d["lm_head"].format.value == "none"  # Embedding rule does not match a Linear


def test_module_type_matches_subclasses():
    class MyLinear(nn.Linear):
        pass

    net = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4))
    fm = _formats(
        net,
        PrecisionPolicy(format="none", rules=[{"pattern": "*", "module_type": "Linear", "format": "int8"}]),
    )
    assert fm == {"0": "int8", "1": "int8"}
    fm = _formats(net, PrecisionPolicy(rules=[{"pattern": "*", "module_type": "MyLinear", "format": "int8"}]))
    assert fm == {"0": "int8", "1": "none"}


def test_partial_stage_needs_num_blocks_for_the_last_blocks():
    # a stage holding layers 5..8 of a 10-block model ([embed, 10 blocks, head]): names are layer indices
    stage = nn.Module()
    for i in range(5, 9):
        stage.add_module(str(i), _Block())
    blocks = list(range(1, 11))
    fm = _formats(stage, WeightsConfig(format="int8", keep_last_blocks=3), block_layers=blocks)
    # block ordinal of layer 8 is 7; with 10 blocks the last 3 are ordinals 7, 8, 9
    assert fm["8.qkv"] == "none" and fm["7.qkv"] == "int8"
    fm = _formats(stage, WeightsConfig(format="int8", keep_last_blocks=3), block_layers=blocks, num_blocks=12)
    assert fm["8.qkv"] == "int8"


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"policy rule 1 .*format='int3'.*allowed formats: none, int8"):
        PrecisionPolicy(format="int8", rules=[("*.qkv", "int4"), ("*", "int3")])
    with pytest.raises(ValueError, match="policy format='int2' is not a weight format; allowed"):
        PrecisionPolicy(format="int2")
    with pytest.raises(ValueError, match=r"invalid weights config: weights.rules.0.format='nf3'"):
        as_policy({"format": "int8", "rules": [{"pattern": "*", "format": "nf3"}]})
    with pytest.raises(ValueError, match=r"policy rule 0 .*: pattern='\(\[' is not a regular expression"):
        PrecisionPolicy(rules=[{"pattern": "([", "match": "regex", "format": "int8"}])
    with pytest.raises(TypeError, match="expected a PrecisionRule"):
        PrecisionPolicy(rules=[42])


def test_explain_totals_equal_the_converted_storage():
    torch.manual_seed(0)
    cfg = WeightsConfig(format="nf4", block_size=32, keep_first_blocks=1, keep_last_blocks=1)
    net = _Net(n=4, d=24)
    text = explain(net, cfg)
    rows = [d for d in plan(net, cfg) if d.quantized]
    want_saved = sum(
        net.get_submodule(d.name).weight.numel() * 4
        - sum(weight_storage_bytes(d.shape, d.format, 32).values())
        for d in rows
    )
    convert_model(net, cfg)
    real_saved = sum(
        m.in_features * m.out_features * 4 - m.qweight.nbytes
        for m in net.modules()
        if isinstance(m, QuantLinear)
    )
    assert real_saved == want_saved
    assert f"saved {want_saved} B" in text
    assert "blocks.1.qkv" in text and "keep: first 1 block(s)" in text
    assert text.splitlines()[-1].startswith(
        f"total: {len(list(plan(net, cfg)))} linear layers, {len(rows)} low-bit"
    )
    # explain on the converted model reports the same
    assert f"saved {want_saved} B" in explain(net, cfg)
