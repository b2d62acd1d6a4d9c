"""Precision policy: which ``nn.Linear`` layers get which low-bit weight format.

A policy is an ordered list of rules on module names (glob or regex) and types, checked first,
then the defaults that keep the sensitive parts of a transformer in high precision:

1. user rules (``WeightsConfig.rules``), first match wins, ``format: none`` keeps a layer dense;
2. layers whose weight is shared with another module (tied embeddings) stay dense;
3. names that look like embeddings, norms or the LM head (``embed``, ``wte``, ``lm_head``, ...);
4. the first ``keep_first_blocks`` and last ``keep_last_blocks`` transformer blocks;
5. everything else gets ``WeightsConfig.format``.

Biases never get a low-bit format (a ``QuantLinear`` keeps its bias dense).

Block indices come from names such as ``blocks.3.attn.qkv``, ``layers.3.mlp.fc`` or ``h.3.attn``.
A DeepSpeed ``PipelineModule`` names its layers by their index in the layer list (``3.attn.qkv``,
where layer 0 may be the embedding): pass ``block_layers``, the layer indices that are transformer
blocks (for the whole model, not only this stage), and the block ordinal is that index's position
in the list. ``num_blocks`` must be given when a stage holds only part of the model, or the last
blocks cannot be known.

``plan(model, policy)`` is pure data (a list of ``LayerDecision``); ``explain`` prints it. A layer
already converted (``quant.linear.QuantLinear``, one layer up) is recognised by its low-bit weight
(``qweight``, a ``QuantizedWeight``) and the dense dtype it records (``dense_dtype``), so the policy
needs nothing from the layers it decides for.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError
from torch import nn

from deepspeed_ppq.config import PrecisionRule, WeightFormat, WeightsConfig
from deepspeed_ppq.quant.formats import QuantizedWeight, weight_storage_bytes

__all__ = [
    "PrecisionPolicy",
    "LayerDecision",
    "as_policy",
    "block_index",
    "plan",
    "explain",
    "DEFAULT_KEEP_PATTERNS",
]

# Name parts (between dots) that mark a sensitive layer; matched case-insensitively as regexes
# against each dotted component.
DEFAULT_KEEP_PATTERNS: tuple[str, ...] = (
    r".*embed.*",
    r"wte",
    r"wpe",
    r"lm_head",
    r"head",
    r"output_layer",
    r"embed_out",
    r".*norm.*",
    r"ln(_\w+)?",
)

_BLOCK_CONTAINERS = ("blocks", "block", "layers", "layer", "h", "decoder.layers", "encoder.layers")
_BLOCK_RE = re.compile(r"(?:^|\.)(?:blocks|block|layers|layer|h)\.(\d+)(?:\.|$)")
_LEADING_INDEX_RE = re.compile(r"^(\d+)(?:\.|$)")


@dataclass(frozen=True)
class LayerDecision:
    """The policy's verdict on one ``nn.Linear``.

    ``reason`` says which rule decided (``"rule 0: blocks.*.mlp.*"``, ``"keep: first block"``, ...).
    """

    name: str
    module_type: str
    shape: tuple[int, ...]
    format: WeightFormat
    reason: str
    block: int | None = None

    @property
    def quantized(self) -> bool:
        return self.format != WeightFormat.none


def _compile_rule(rule: PrecisionRule):
    if rule.match == "regex":  # PrecisionRule checked that it compiles
        rx = re.compile(rule.pattern)
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, rule.pattern)


def _to_rule(i: int, rule) -> PrecisionRule:
    if isinstance(rule, PrecisionRule):
        return rule
    if isinstance(rule, (tuple, list)) and len(rule) == 2:
        rule = {"pattern": rule[0], "format": rule[1]}
    if not isinstance(rule, dict):
        raise TypeError(
            f"policy rule {i}: expected a PrecisionRule, a dict or a (pattern, format) pair, "
            f"got {type(rule).__name__}"
        )
    try:
        return PrecisionRule.model_validate(rule)
    except ValidationError as err:
        allowed = ", ".join(f.value for f in WeightFormat)
        msgs = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            if not loc:  # the rule as a whole (a pattern that is no regex): the message names the field
                msgs.append(e["msg"].removeprefix("Value error, "))
                continue
            extra = f" (allowed formats: {allowed})" if loc == "format" else ""
            msgs.append(f"{loc}={e.get('input')!r}: {e['msg']}{extra}")
        raise ValueError(f"policy rule {i} {rule}: " + "; ".join(msgs)) from None


@dataclass
class PrecisionPolicy:
    """Ordered precision rules plus the high-precision defaults.

    Args:
        format: the format of every ``nn.Linear`` no rule or default keeps dense.
        rules: ``PrecisionRule``s (or dicts, or ``(glob, format)`` pairs), checked in order.
        keep_first_blocks / keep_last_blocks: number of leading/trailing transformer blocks kept dense.
        keep_patterns: regexes on dotted name parts that mark sensitive layers; ``()`` disables.
        block_layers: for ``PipelineModule`` names (``"3.attn.qkv"``): the layer indices that are blocks.
        num_blocks: total blocks in the whole model; needed when a stage holds part of it.
        weights: the ``WeightsConfig`` the policy came from (block size, scale dtype, mode, LoRA).
    """

    format: WeightFormat = WeightFormat.none
    rules: list = field(default_factory=list)
    keep_first_blocks: int = 1
    keep_last_blocks: int = 1
    keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS
    block_layers: Sequence[int] | None = None
    num_blocks: int | None = None
    weights: WeightsConfig | None = None

    def __post_init__(self) -> None:
        try:
            self.format = WeightFormat(self.format)
        except ValueError:
            allowed = ", ".join(f.value for f in WeightFormat)
            raise ValueError(
                f"policy format={self.format!r} is not a weight format; allowed: {allowed}"
            ) from None
        self.rules = [_to_rule(i, r) for i, r in enumerate(self.rules)]
        self._matchers = [_compile_rule(r) for r in self.rules]
        self._keep = [re.compile(p, re.IGNORECASE) for p in self.keep_patterns]
        for name, v in (
            ("keep_first_blocks", self.keep_first_blocks),
            ("keep_last_blocks", self.keep_last_blocks),
        ):
            if v < 0:
                raise ValueError(f"policy {name}={v} must be >= 0")
        if self.weights is None:
            self.weights = WeightsConfig(
                format=self.format,
                keep_first_blocks=self.keep_first_blocks,
                keep_last_blocks=self.keep_last_blocks,
                rules=self.rules,
            )
        if self.block_layers is not None:
            self.block_layers = list(self.block_layers)
            self._block_pos = {layer: i for i, layer in enumerate(self.block_layers)}

    @classmethod
    def from_config(cls, cfg: WeightsConfig, **kwargs) -> PrecisionPolicy:
        """The policy a ``WeightsConfig`` describes; ``kwargs`` add ``block_layers``/``num_blocks``."""
        return cls(
            format=cfg.format,
            rules=list(cfg.rules),
            keep_first_blocks=cfg.keep_first_blocks,
            keep_last_blocks=cfg.keep_last_blocks,
            weights=cfg,
            **kwargs,
        )

    def block_of(self, name: str) -> int | None:
        """The block ordinal of a dotted module name, or None outside the transformer blocks."""
        return block_index(name, self.block_layers)

    def decide(
        self, name: str, module: nn.Module, num_blocks: int | None, tied: bool = False
    ) -> LayerDecision:
        """The format of one module, with the reason."""
        mtype = type(module).__name__
        shape = tuple(module.weight.shape) if getattr(module, "weight", None) is not None else ()
        block = self.block_of(name)

        def out(fmt, reason):
            return LayerDecision(name, mtype, shape, WeightFormat(fmt), reason, block)

        mro = {c.__name__ for c in type(module).__mro__}
        for i, (rule, matches) in enumerate(zip(self.rules, self._matchers)):
            if rule.module_type is not None and rule.module_type not in mro:
                continue
            if matches(name):
                return out(rule.format, f"rule {i}: {rule.pattern}")
        if tied:
            return out(WeightFormat.none, "keep: weight shared with another module")
        for part in name.split("."):
            for rx in self._keep:
                if rx.fullmatch(part):
                    return out(WeightFormat.none, f"keep: sensitive name ({part})")
        if block is not None:
            if block < self.keep_first_blocks:
                return out(WeightFormat.none, f"keep: first {self.keep_first_blocks} block(s)")
            if num_blocks is not None and block >= num_blocks - self.keep_last_blocks:
                return out(WeightFormat.none, f"keep: last {self.keep_last_blocks} block(s)")
        return out(self.format, "default format")


def block_index(name: str, block_layers: Sequence[int] | None = None) -> int | None:
    """The transformer-block ordinal a dotted module name belongs to.

    ``blocks.3.attn.qkv`` / ``layers.3.x`` / ``h.3.x`` -> 3. With ``block_layers`` (PipelineModule
    layer indices that are blocks), ``"5.attn.qkv"`` -> position of 5 in ``block_layers``, and a
    leading index that is not a block (embedding, head) -> None.
    """
    if block_layers is not None:
        m = _LEADING_INDEX_RE.match(name)
        if m is not None:
            layer = int(m.group(1))
            pos = {lay: i for i, lay in enumerate(block_layers)}
            return pos.get(layer)
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def as_policy(policy_or_cfg, **kwargs) -> PrecisionPolicy:
    """A ``PrecisionPolicy`` from a policy, a ``WeightsConfig``, a dict of its fields or a format name."""
    if isinstance(policy_or_cfg, PrecisionPolicy):
        if kwargs:
            raise ValueError(
                f"as_policy: {sorted(kwargs)} can only be given with a WeightsConfig, not a policy"
            )
        return policy_or_cfg
    if isinstance(policy_or_cfg, (str, WeightFormat)):
        return PrecisionPolicy(format=policy_or_cfg, **kwargs)
    if isinstance(policy_or_cfg, dict):
        try:
            policy_or_cfg = WeightsConfig.model_validate(policy_or_cfg)
        except ValidationError as err:
            msgs = "; ".join(
                f"weights.{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in err.errors()
            )
            raise ValueError(f"invalid weights config: {msgs}") from None
    if isinstance(policy_or_cfg, WeightsConfig):
        return PrecisionPolicy.from_config(policy_or_cfg, **kwargs)
    raise TypeError(
        f"expected a PrecisionPolicy, WeightsConfig, dict or format name, got {type(policy_or_cfg).__name__}"
    )


def _converted(mod: nn.Module) -> bool:
    """A linear layer already converted to low bit (``QuantLinear``): it holds a ``QuantizedWeight``."""
    return isinstance(getattr(mod, "qweight", None), QuantizedWeight)


def _linear_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) or _converted(mod):
            yield name, mod


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of weight tensors held by more than one module (tied embeddings and the like)."""
    owners: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {k for k, v in owners.items() if v > 1}


def plan(model: nn.Module, policy, **kwargs) -> list[LayerDecision]:
    """The policy's decision for every ``nn.Linear`` (and already-converted ``QuantLinear``) in ``model``.

    Args:
        model: any module; its names are matched as ``named_modules`` gives them.
        policy: a ``PrecisionPolicy``, ``WeightsConfig``, dict or format name (see ``as_policy``).
        **kwargs: ``block_layers``/``num_blocks`` when ``policy`` is not a ``PrecisionPolicy`` yet.

    Returns:
        One ``LayerDecision`` per linear layer, in module order.
    """
    pol = as_policy(policy, **kwargs)
    mods = list(_linear_modules(model))
    num_blocks = pol.num_blocks
    if num_blocks is None:
        if pol.block_layers is not None:
            num_blocks = len(pol.block_layers)
        else:
            blocks = [pol.block_of(n) for n, _ in model.named_modules()]
            blocks = [b for b in blocks if b is not None]
            num_blocks = max(blocks) + 1 if blocks else None
    shared = _shared_weights(model)
    out = []
    for name, mod in mods:
        w = getattr(mod, "weight", None)
        tied = w is not None and id(w) in shared
        out.append(pol.decide(name, mod, num_blocks, tied=tied))
    return out


def _dense_weight_bytes(mod: nn.Module) -> int:
    if _converted(mod):
        return math.prod(mod.qweight.shape) * mod.dense_dtype.itemsize
    return mod.weight.numel() * mod.weight.element_size()


def explain(model: nn.Module, policy, file=None, **kwargs) -> str:
    """A table of every linear layer's format and the weight bytes it saves, with a total.

    Bytes are exact storage bytes of the compute copy (codes + scales, ``quant.formats.weight_storage_bytes``)
    against the layer's weight in its current dtype; the fp32 master weight of "train" mode and
    optimizer states are not in this table (see ``ledger_from_model`` for those).

    Returns:
        The table as a string (also printed to ``file`` when given).
    """
    pol = as_policy(policy, **kwargs)
    w = pol.weights
    rows = []
    total_dense = total_stored = 0
    for d in plan(model, pol):
        mod = model.get_submodule(d.name)
        dense = _dense_weight_bytes(mod)
        if d.quantized:
            stored = sum(
                weight_storage_bytes(
                    d.shape, d.format, w.block_size, w.scale_dtype, w.double_quant, w.fp8_scale
                ).values()
            )
        else:
            stored = dense
        total_dense += dense
        total_stored += stored
        rows.append(
            (d.name, "x".join(map(str, d.shape)), d.format.value, dense, stored, dense - stored, d.reason)
        )
    head = ("layer", "shape", "format", "dense B", "stored B", "saved B", "reason")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(
            str(c).ljust(widths[i]) if i in (0, 1, 2, 6) else str(c).rjust(widths[i]) for i, c in enumerate(r)
        ).rstrip()
        for r in [head, *rows]
    ]
    pct = 100.0 * (total_dense - total_stored) / total_dense if total_dense else 0.0
    lines.append(
        f"total: {len(rows)} linear layers, {sum(r[2] != 'none' for r in rows)} low-bit; "
        f"weights {total_dense} B -> {total_stored} B, saved {total_dense - total_stored} B ({pct:.1f}%)"
    )
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text
