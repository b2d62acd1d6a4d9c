"""Reduced-scale reproduction of the activation/gradient compression study, in three settings.

The study (see docs/method.md) compressed activations and gradients at
the 3 boundaries of a 4-stage pipeline, simulated in one process. This benchmark does the same with
``compressed_boundary`` (the single-process reference that the distributed engines must match) in:

* ``scratch``: the small GPT (``deepspeed_ppq.models``) trained from scratch on stdlib text
  (boundaries after blocks n/4, n/2, 3n/4);
* ``finetune``: the study's transformer setting (GPT-2 fine-tuning): the small GPT is pretrained once
  uncompressed on the same text (state cached in a temp dir for the run), then every case fine-tunes
  that checkpoint with compression on other stdlib files and is evaluated on held-out files of them;
* ``cnn``: the study's CNN setting (ResNet-18 / CIFAR-10): a small ReLU ResNet on generated
  oriented-grating images (``quality_cnn.py``), evaluated by test accuracy and loss.

Every case of a setting trains on the same batches from the same initialisation; each trained model is
evaluated twice, with compression on (codec in eval mode) and off, and compared with the uncompressed run.

Cases: the uncompressed run at 3 seeds (its seed-to-seed spread is the noise every difference is
judged against); bits a8/g8, a4/g8, a8/g4, a4/g6, a4/g4, a2/g8, a8/g2 (per-token scales on the GPT,
per-channel on the CNN); per-sample scales (the study's granularity) at a4/g8, a8/g4, a4/g6, a4/g4,
a2/g8 and a8/g2; TopK 50% and 10% with index reuse and with independent gradient indices (``--topk30``
adds 30%); TopK 10% with EF and EF21; AQ-SGD at a2/g8.

    python benchmarks/e2e/bench_quality.py                      # all settings, ~13 min on 2 cores
    python benchmarks/e2e/bench_quality.py --settings scratch   # only the from-scratch GPT table
    python benchmarks/e2e/bench_quality.py --quick --out /tmp/q # smoke run of all cases, ~1.5 min

Results: benchmarks/results/quality_{small_gpt,gpt_finetune,cnn}.{json,md} and quality_findings.md
(which finding holds in which setting).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
# quality_cnn beside this file, the examples' text (examples/stdlib_text.py), the package
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "examples"), str(ROOT)]

from stdlib_text import TokenDataset, build_token_datasets, finetune_texts  # noqa: E402

from deepspeed_ppq.config import AQSGDConfig, CodecConfig, PPQConfig  # noqa: E402
from deepspeed_ppq.models import GPTConfig, gpt_layers, gpt_loss  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Case:
    """One training run: the activation and gradient codecs at every boundary."""

    name: str
    group: str
    act: dict = field(default_factory=dict)
    grad: dict = field(default_factory=dict)
    aqsgd: bool = False
    seed: int | None = None  # None: the run's --seed (only the noise runs of the baseline differ)


def _q(bits: int, gran: str = "token") -> dict:
    return {"method": "quant", "bits": bits, "granularity": gran}


def _topk(ratio: float, **kw) -> dict:
    return {"method": "topk", "topk_ratio": ratio, **kw}


def study_cases(noise_seeds: int = 2, topk30: bool = False, fine: str = "per-token") -> list[Case]:
    """The study's cases; ``noise_seeds`` extra uncompressed runs at seeds --seed+1, --seed+2, ...

    ``fine`` names what ``granularity="token"`` means in the setting (per-token on the GPT, per-channel
    on the CNN); it only labels the group.
    """
    cases = [Case("uncompressed", "baseline")]
    cases += [Case(f"uncompressed seed+{k}", "seed noise", seed=k) for k in range(1, noise_seeds + 1)]
    for a, g in [(8, 8), (4, 8), (8, 4), (4, 6), (4, 4), (2, 8), (8, 2)]:
        cases.append(Case(f"a{a}/g{g}", f"bits ({fine} scales)", _q(a), _q(g)))
    # per-sample scales: the study's granularity (one min-max scale per vector)
    for a, g in [(4, 8), (8, 4), (4, 6), (4, 4), (2, 8), (8, 2)]:
        cases.append(Case(f"a{a}/g{g} per-sample", "granularity", _q(a, "sample"), _q(g, "sample")))
    for r in (0.5, 0.3, 0.1) if topk30 else (0.5, 0.1):
        pct = int(round(r * 100))
        cases.append(Case(f"top{pct}% reuse", "topk", _topk(r), _topk(r, reuse_indices=True)))
        cases.append(Case(f"top{pct}% no reuse", "topk", _topk(r), _topk(r, reuse_indices=False)))
    for ef in ("ef", "ef21"):
        cases.append(Case(f"top10% reuse + {ef.upper()}", "error feedback",
                          _topk(0.1, error_feedback=ef), _topk(0.1, reuse_indices=True)))
    cases.append(Case("a2/g8 AQ-SGD", "aq-sgd", _q(2), _q(8), aqsgd=True))
    return cases


class Boundary(nn.Module):
    """A pipeline boundary in one process: activations compressed forward, gradients backward, through
    the channel the engines use (``compress.BoundaryChannel``, single-process side ``"both"``).

    At evaluation ``compress`` picks between the activation codec (stateless, as the engines run it
    when ``compress_eval`` is on) and no codec at all, whatever the config's default.
    """

    def __init__(self, name: str, act: CodecConfig, grad: CodecConfig, aqsgd: AQSGDConfig | None):
        super().__init__()
        from deepspeed_ppq.compress import BoundaryChannel

        self.name = name
        self.act = act
        self.enabled = act.enabled or grad.enabled
        ppq = PPQConfig(activations=act, gradients=grad, aqsgd=aqsgd or AQSGDConfig())
        self.channel = BoundaryChannel(ppq, label=name)
        eval_act = act.model_copy(update={"compress_eval": True}) if act.enabled else act  # none sends as is
        self.eval_channel = BoundaryChannel(PPQConfig(activations=eval_act), label=f"{name} eval")
        self.compress = True
        self.sample_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_ppq.compress import compressed_boundary

        if not self.enabled:
            return x
        if self.training:
            return compressed_boundary(x, self.channel, sample_ids=self.sample_ids)
        if not (self.compress and self.act.enabled):
            return x
        return compressed_boundary(x, self.eval_channel, training=False)


def boundary_positions(n_layers: int, stages: int = 4) -> list[int]:
    """Indices into ``gpt_layers`` after which a boundary sits: after blocks n/4, n/2, 3n/4 (4 stages)."""
    return [round(n_layers * s / stages) for s in range(1, stages)]  # layer 0 is the embedding


def build_model(cfg: GPTConfig, case: Case, seed: int, state: dict | None = None
                ) -> tuple[nn.Sequential, list[Boundary]]:
    """The GPT's layers with a ``Boundary`` after each cut; ``state``: a pretrained
    ``nn.Sequential(*gpt_layers(cfg))`` state dict to start from (the fine-tuning setting)."""
    act = CodecConfig(**case.act)
    grad = CodecConfig(**case.grad)
    aq = AQSGDConfig(enabled=True) if case.aqsgd else None
    layers, bounds = [], []
    cuts = set(boundary_positions(cfg.n_layers))
    plain = gpt_layers(cfg, seed)
    if state is not None:
        nn.Sequential(*plain).load_state_dict(state)
    for i, layer in enumerate(plain):
        layers.append(layer)
        if i in cuts:
            b = Boundary(f"b{len(bounds)}", act, grad, aq)
            bounds.append(b)
            layers.append(b)
    return nn.Sequential(*layers), bounds


def _batch(ds, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[int(i)] for i in idx))
    return torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def evaluate(model: nn.Module, val, batch: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(val), batch):
        idx = torch.arange(s, min(s + batch, len(val)))
        x, y = _batch(val, idx)
        total += gpt_loss(model(x), y).item() * len(idx)
        n += len(idx)
    model.train()
    return total / n


def _gpt_cfg(args: dict) -> GPTConfig:
    return GPTConfig(vocab_size=args["vocab"], seq_len=args["seq_len"], d_model=args["d_model"],
                     n_heads=args["heads"], n_layers=args["layers"])


def _gpt_data(args: dict, setting: str) -> tuple[TokenDataset, TokenDataset]:
    """(train, validation) of a GPT setting: the stdlib split, or the fine-tuning files (saved by main)."""
    if setting == "finetune":
        tok = torch.load(args["ft_data"])
        T = args["seq_len"]
        return TokenDataset(tok["train"].numpy(), T), TokenDataset(tok["val"].numpy(), T)
    train, val, _ = build_token_datasets(seq_len=args["seq_len"], vocab_size=args["vocab"],
                                         max_bytes=args["max_bytes"])
    return train, val


def _train_gpt(model: nn.Module, bounds: list[Boundary], train, steps: int, batch: int, lr: float,
               seed: int) -> tuple[list[float], bool, float]:
    """AdamW with linear warm-up (10% of the steps) then cosine; returns (losses, diverged, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    # Samples come round once per epoch (AQ-SGD sees each sample repeatedly only then).
    epochs = steps * batch // len(train) + 1
    order = torch.cat([torch.randperm(len(train), generator=gen) for _ in range(epochs)])
    t0 = time.perf_counter()
    losses, nonfinite = [], False
    for step in range(steps):
        idx = order[step * batch:(step + 1) * batch]
        x, y = _batch(train, idx)
        for b in bounds:
            b.sample_ids = idx
        loss = gpt_loss(model(x), y)
        if not torch.isfinite(loss):
            nonfinite = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, nonfinite, time.perf_counter() - t0


def pretrain(args: dict) -> dict:
    """The fine-tuning setting's starting point: the GPT trained uncompressed on the from-scratch
    setting's training text for ``--pretrain-steps``; its state goes to ``args["ckpt"]`` (a worker job).

    Returns the reference row: the pretrained model on the fine-tuning validation files, not fine-tuned.
    """
    torch.set_num_threads(1)
    train, val = _gpt_data(args, "scratch")
    model = nn.Sequential(*gpt_layers(_gpt_cfg(args), args["seed"]))
    losses, nonfinite, secs = _train_gpt(model, [], train, args["pretrain_steps"], args["batch"], args["lr"],
                                         args["seed"])
    if nonfinite:
        raise SystemExit("pretraining diverged (non-finite loss): lower --lr or --pretrain-steps")
    torch.save(model.state_dict(), args["ckpt"])
    _, ft_val = _gpt_data(args, "finetune")
    v = evaluate(model, ft_val, args["batch"])
    return {"name": "pretrained, not fine-tuned", "group": "reference", "seed": args["seed"], "act": {},
            "grad": {}, "aqsgd": False, "train_seconds": round(secs, 2), "nonfinite": False,
            "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
            "pretrain_val_loss": evaluate(model, val, args["batch"]),
            "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 50)]],
            "val_loss_compressed": v, "val_loss_plain": v}


def run_case(case: Case, args: dict, setting: str = "scratch") -> dict:
    """Train one case of a GPT setting and evaluate it with and without compression (in a worker).

    ``scratch``: from the seed's initialisation for ``--steps`` at ``--lr``; ``finetune``: from the
    pretrained state for ``--ft-steps`` at ``--ft-lr`` on the fine-tuning files (the seed changes only
    the batch order there).
    """
    torch.set_num_threads(1)
    train, val = _gpt_data(args, setting)
    seed = args["seed"] + (case.seed or 0)
    if setting == "finetune":
        state, steps, lr = torch.load(args["ckpt"]), args["ft_steps"], args["ft_lr"]
    else:
        state, steps, lr = None, args["steps"], args["lr"]
    model, bounds = build_model(_gpt_cfg(args), case, seed, state)
    losses, nonfinite, train_s = _train_gpt(model, bounds, train, steps, args["batch"], lr, seed)
    out = {"name": case.name, "group": case.group, "seed": seed, "act": case.act, "grad": case.grad,
           "aqsgd": case.aqsgd,
           "train_seconds": round(train_s, 2), "nonfinite": nonfinite,
           "train_loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
           "loss_curve": [round(v, 4) for v in losses[:: max(1, len(losses) // 50)]]}
    if nonfinite:
        out.update(val_loss_compressed=float("nan"), val_loss_plain=float("nan"))
        return out
    for b in bounds:
        b.compress = True
    out["val_loss_compressed"] = evaluate(model, val, args["batch"])
    for b in bounds:
        b.compress = False
    out["val_loss_plain"] = evaluate(model, val, args["batch"])
    act = CodecConfig(**case.act)
    out["eval_compressed_by_default"] = act.eval_compressed
    # Bytes on the wire per boundary per micro-batch, from the codec's own size formula.
    from deepspeed_ppq.compress.codecs import payload_nbytes

    shape = (args["batch"], args["seq_len"], args["d_model"])
    raw = math.prod(shape) * 4
    grad = CodecConfig(**case.grad)
    values_only = grad.method == "topk" and grad.reuse_indices
    out["act_bytes_ratio"] = payload_nbytes(act, shape, torch.float32) / raw
    out["grad_bytes_ratio"] = payload_nbytes(grad, shape, torch.float32, values_only=values_only) / raw
    return out


def prepare_finetune(args: dict, workdir: Path) -> None:
    """Encode the fine-tuning files with the pretraining tokenizer into ``workdir`` (read by the workers)."""
    _, _, tok = build_token_datasets(seq_len=args["seq_len"], vocab_size=args["vocab"],
                                     max_bytes=args["max_bytes"])
    try:  # the stdlib files past the pretraining text (--max-bytes), skipping --ft-skip-bytes
        train_text, val_text = finetune_texts(args["max_bytes"], args["ft_skip_bytes"], args["ft_bytes"])
    except ValueError as e:
        raise SystemExit(f"{e} (--max-bytes, --ft-skip-bytes, --ft-bytes)") from None
    data = {"train": torch.from_numpy(tok.encode(train_text)), "val": torch.from_numpy(tok.encode(val_text))}
    args["ft_data"] = str(workdir / "finetune_tokens.pt")
    args["ckpt"] = str(workdir / "pretrained.pt")
    torch.save(data, args["ft_data"])
    args["ft_train_windows"] = (len(data["train"]) - 1) // args["seq_len"]
    args["ft_val_windows"] = (len(data["val"]) - 1) // args["seq_len"]
    args["ft_text_bytes"] = [len(train_text), len(val_text)]


def check_against_reference(args: dict) -> None:
    """Boundaries with codec ``none`` leave the model bit-identical to the plain GPT, forward and backward;
    an 8-bit boundary changes the loss only slightly."""
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=args["vocab"], seq_len=args["seq_len"], d_model=args["d_model"],
                    n_heads=args["heads"], n_layers=args["layers"])
    ref = nn.Sequential(*gpt_layers(cfg, args["seed"]))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    loss_ref = gpt_loss(ref(x), x)
    loss_ref.backward()
    for case, tol in ((Case("none", "check", {"method": "none"}, {"method": "none"}), 0.0),
                      (Case("a8/g8", "check", _q(8), _q(8)), 0.05)):
        model, _ = build_model(cfg, case, args["seed"])
        loss = gpt_loss(model(x), x)
        loss.backward()
        if abs(loss.item() - loss_ref.item()) > tol:
            raise SystemExit(f"reference check failed for {case.name}: "
                             f"loss {loss.item()} vs {loss_ref.item()}")
        if tol == 0.0:
            g_ref = [p.grad for p in ref.parameters()]
            g = [p.grad for p in model.parameters()]
            if any(not torch.equal(a, b) for a, b in zip(g_ref, g)):
                raise SystemExit("reference check failed: codec 'none' changed a gradient")
    print("reference check: codec 'none' is bit-identical to the plain GPT; a8/g8 loss within 0.05")


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.4f}"


def _ppl(v: float) -> str:
    return "nan" if not math.isfinite(v) or v > 50 else f"{math.exp(v):.1f}"


# metric -> (True when lower is better, number format, unit)
_METRICS = {"val_loss": (True, ".4f", ""), "acc": (False, ".2f", " pts")}


def seed_noise(rows: list[dict], metric: str = "val_loss") -> float:
    """Largest distance of an uncompressed noise run's ``metric`` (plain evaluation) from the seed-0 run's
    (nan if there is no noise run)."""
    key = f"{metric}_plain"
    base = next(r for r in rows if r["name"] == "uncompressed")[key]
    spread = [abs(r[key] - base) for r in rows if r["group"] == "seed noise"]
    return max(spread) if spread else float("nan")


def check_findings(rows: list[dict], metric: str = "val_loss", fine: str = "per-token"
                   ) -> list[tuple[str, str, str]]:
    """The study's directions checked on the measured numbers: ``(finding, sentence, verdict)`` each.

    ``metric``: ``val_loss`` (lower is better) or ``acc`` (test accuracy in %, higher is better).
    ``fine``: what ``granularity="token"`` is in the setting (per-token on the GPT, per-channel on the CNN).
    A direction "holds" when the case the study calls worse loses more than the other by more than the
    seed noise of the uncompressed run; with the right sign but a smaller gap it is "same direction,
    within seed noise"; with the opposite sign it does NOT hold, either within seed noise (no difference
    measured) or beyond it (reversed). ``verdict`` is one of "holds", "within noise (same sign)",
    "within noise (opposite sign)", "no difference", "reversed", "not measured".
    """
    lower, spec, unit = _METRICS[metric]
    by = {r["name"]: r for r in rows}
    base = by["uncompressed"][f"{metric}_plain"]
    noise = seed_noise(rows, metric)
    fmt = lambda v: f"{v:{spec}}{unit}"  # noqa: E731
    sfmt = lambda v: f"{v:+{spec}}{unit}"  # noqa: E731
    name = "Δ" if metric == "val_loss" else "Δ acc"

    def d(case: str, ev: str = "compressed") -> float:
        """Change of the metric from the uncompressed run (nan if the case is missing)."""
        return by[case][f"{metric}_{ev}"] - base if case in by else float("nan")

    def loss(delta: float) -> float:
        """How much worse: the change itself for a loss, minus it for an accuracy."""
        return delta if lower else -delta

    def verdict(worse: float, better: float) -> tuple[str, str]:
        """The study says the change ``worse`` hurts more than the change ``better``."""
        worse, better = loss(worse), loss(better)
        if not (math.isfinite(worse) and math.isfinite(better)):
            return "not measured (case missing or diverged)", "not measured"
        gap = worse - better
        if gap > 0 and (not math.isfinite(noise) or gap > noise):
            return f"holds (gap {sfmt(gap)} > seed noise {fmt(noise)})", "holds"
        if gap > 0:
            return (f"same direction, within seed noise (gap {sfmt(gap)} <= {fmt(noise)})",
                    "within noise (same sign)")
        if gap == 0:
            return f"does NOT hold: no difference (gap 0; seed noise {fmt(noise)})", "no difference"
        if math.isfinite(noise) and -gap <= noise:
            return (f"does NOT hold: opposite sign, within seed noise (gap {sfmt(gap)}; seed noise "
                    f"{fmt(noise)})", "within noise (opposite sign)")
        return f"does NOT hold: reversed (gap {sfmt(gap)}; seed noise {fmt(noise)})", "reversed"

    out = []

    def add(key: str, text: str, v: tuple[str, str]) -> None:
        out.append((key, f"{text} -> {v[0]}", v[1]))

    for bits in (4, 2):
        for tag, sfx in ((fine, ""), ("per-sample", " per-sample")):
            n_a, n_g = f"a{bits}/g8{sfx}", f"a8/g{bits}{sfx}"
            if n_a in by and n_g in by:
                ga, gg = d(n_a), d(n_g)
                key = "per-token/channel" if tag == fine else tag
                add(f"gradients more sensitive than activations ({bits} bits, {key} scales, swapped)",
                    f"gradients more sensitive than activations ({bits} bits, {tag} scales, swapped): "
                    f"{name} {n_g} = {sfmt(gg)}, {name} {n_a} = {sfmt(ga)}", verdict(gg, ga))
    for tag, sfx in ((fine, ""), ("per-sample", " per-sample")):
        if sfx and f"a4/g4{sfx}" not in by:
            continue
        key = "per-token/channel" if tag == fine else tag
        g8, g6, g4 = (d(f"a4/g{g}{sfx}") for g in (8, 6, 4))
        for lo, dl in ((4, g4), (6, g6)):
            add(f"fewer gradient bits cost more ({key} scales, a4/g{lo} vs a4/g8)",
                f"fewer gradient bits cost more ({tag} scales): {name} a4/g8, a4/g6, a4/g4 = "
                f"{sfmt(g8)}, {sfmt(g6)}, {sfmt(g4)}; g{lo} vs g8", verdict(dl, g8))
    for pct in (50, 10):
        r, nr = d(f"top{pct}% reuse"), d(f"top{pct}% no reuse")
        add(f"TopK{pct}% without index reuse worse",
            f"TopK{pct}% without index reuse worse: {name} reuse = {sfmt(r)}, no reuse = {sfmt(nr)}",
            verdict(nr, r))
    ts, tp = d("top10% reuse"), d("top10% reuse", "plain")
    add("a TopK-trained model needs TopK at evaluation",
        f"a TopK-trained model needs TopK at evaluation: {name} top10% with it = {sfmt(ts)}, "
        f"without = {sfmt(tp)}", verdict(tp, ts))
    qs, qp = d("a2/g8"), d("a2/g8", "plain")
    add("2-bit activations need compression at evaluation",
        f"2-bit activations need compression at evaluation: {name} a2/g8 with it = {sfmt(qs)}, "
        f"without = {sfmt(qp)}", verdict(qp, qs))
    for bits in (4, 2):
        smp, t = d(f"a{bits}/g8 per-sample"), d(f"a{bits}/g8")
        add(f"per-token/channel scales beat per-sample at a{bits}/g8",
            f"{fine} scales beat per-sample at a{bits}/g8: {name} per-sample = {sfmt(smp)}, "
            f"{fine} = {sfmt(t)}", verdict(smp, t))
    for ef in ("EF", "EF21"):
        n = f"top10% reuse + {ef}"
        if n in by:
            gap_ef = loss(d(n, "plain")) - loss(d(n))
            gap = loss(d("top10% reuse", "plain")) - loss(d("top10% reuse"))
            # compare as losses of the metric: verdict() applies loss() again, so pass them back unflipped
            add(f"{ef} narrows the with/without-compression evaluation gap",
                f"{ef} narrows the with/without-compression evaluation gap: gap {sfmt(gap_ef)} vs "
                f"{sfmt(gap)} without feedback", verdict(loss(gap), loss(gap_ef)))
    return out


def findings(rows: list[dict], metric: str = "val_loss", fine: str = "per-token") -> list[str]:
    """The study's directions, each checked on the measured numbers (reported whatever they show);
    the first line is the seed noise. See ``check_findings``."""
    _, spec, unit = _METRICS[metric]
    n = sum(r["group"] == "seed noise" for r in rows)
    head = (f"seed noise (uncompressed, largest |Δ| over {n} other seeds): "
            f"{seed_noise(rows, metric):{spec}}{unit}")
    return [head] + [text for _, text, _ in check_findings(rows, metric, fine)]


# setting -> results file stem, title, metrics (first: the one findings are judged on), fine granularity
SETTINGS = {
    "scratch": ("quality_small_gpt", "GPT trained from scratch", ("val_loss",), "per-token"),
    "finetune": ("quality_gpt_finetune", "GPT fine-tuned from a pretrained checkpoint", ("val_loss",),
                 "per-token"),
    "cnn": ("quality_cnn", "ReLU ResNet on generated images", ("acc", "val_loss"), "per-channel"),
}


def _machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "cpu": cpu, "cores": os.cpu_count()}


def _describe(setting: str, args: dict) -> list[str]:
    """The paragraph of a setting's markdown that says what was trained on what."""
    gpt = (f"GPT d={args['d_model']}, {args['layers']} blocks, {args['heads']} heads, seq {args['seq_len']}, "
           f"BPE vocab {args['vocab']}")
    cuts = boundary_positions(args["layers"])
    if setting == "scratch":
        return [f"{gpt}; trained from scratch for {args['steps']} steps of {args['batch']} sequences (AdamW "
                f"lr {args['lr']}, warm-up + cosine), seed {args['seed']}; compressed boundaries after "
                f"layers {cuts} of the layer list (3 boundaries of a 4-stage pipeline). Validation: "
                "held-out stdlib files. Δ = validation loss minus the uncompressed run's.",
                f"Epochs: {args['steps'] * args['batch'] / args['train_windows']:.2f} over "
                f"{args['train_windows']} training windows. AQ-SGD sends the change of a sample's "
                "activation since the sample was last seen, so it differs from its plain codec only "
                "once samples come round again (from the second epoch on)."]
    if setting == "finetune":
        return [f"{gpt}. Pretrained once, uncompressed, for {args['pretrain_steps']} steps of "
                f"{args['batch']} sequences "
                f"({args['pretrain_steps'] * args['batch'] / args['train_windows']:.2f} epochs of "
                f"the from-scratch setting's {args['train_windows']} training windows: the first "
                f"{args['max_bytes']:,} bytes of the sorted stdlib files; AdamW lr {args['lr']}, warm-up + "
                "cosine). Every case then fine-tunes that state for "
                f"{args['ft_steps']} steps of {args['batch']} sequences (fresh AdamW, lr {args['ft_lr']}, "
                f"warm-up + cosine) on other stdlib files: {args['ft_bytes']:,} bytes starting "
                f"{args['ft_skip_bytes']:,} bytes after the pretraining text ({args['ft_train_windows']} "
                f"training windows, {args['ft_steps'] * args['batch'] / args['ft_train_windows']:.2f} "
                "epochs), "
                f"and is evaluated on the held-out files of that range ({args['ft_val_windows']} windows). "
                f"Compressed boundaries after layers {cuts}. The seed changes only the batch order here "
                "(the initialisation is the checkpoint). Δ = validation loss minus the uncompressed "
                "fine-tuning run's; the `pretrained, not fine-tuned` row is the checkpoint itself.",
                "AQ-SGD differs from its plain codec only from the second epoch on (not reached here)."]
    w, n, size = args["cnn_width"], args["cnn_batch"], args.get("cnn_size", 16)
    hw = size * size
    return [f"ReLU ResNet (BasicBlocks with BatchNorm; widths {w}/{w}/{2 * w}/{2 * w}, 4 stages, a "
            "compressed boundary after each of the first three: [N, C, H*W] = "
            f"[{n}, {w}, {hw}], [{n}, {w}, {hw}], [{n}, {2 * w}, {hw // 4}]) "
            f"on generated 3x{size}x{size} images of 10 grating orientations (`quality_cnn.make_images`: "
            f"{args['cnn_train']} training, {args['cnn_test']} test images); {args['cnn_steps']} steps of "
            f"{n} ({args['cnn_steps'] * n / args['cnn_train']:.1f} epochs), SGD "
            f"momentum 0.9, lr {args['cnn_lr']}, weight decay 5e-4, warm-up + cosine; seed {args['seed']}. "
            "`token` granularity is one scale per channel of each sample; per-sample is the study's "
            "per-vector min-max. Δ acc in points, Δ loss in test cross-entropy, both against the "
            "uncompressed run."]


def write_results(setting: str, rows: list[dict], args: dict, wall: float, out: Path = RESULTS,
                  machine: dict | None = None) -> tuple[Path, Path, dict]:
    """Write ``<stem>.{json,md}`` of one setting; returns the paths and the setting's checked findings.

    ``machine``: date and machine of a recorded run (re-rendering); default: now, this machine.
    """
    stem, title, metrics, fine = SETTINGS[setting]
    out.mkdir(parents=True, exist_ok=True)
    meta = {**(machine or _machine()), "setting": setting, "args": args,
            "wall_seconds_all_settings": round(wall, 1),
            "train_seconds_sum": round(sum(r["train_seconds"] for r in rows), 1)}
    found = {m: findings(rows, m, fine) for m in metrics}
    checks = {m: check_findings(rows, m, fine) for m in metrics}
    jpath = out / f"{stem}.json"
    jpath.write_text(json.dumps({"meta": meta, "findings": found, "cases": rows}, indent=1))
    cmd = f"`python benchmarks/e2e/bench_quality.py {args['argv']}`".replace(" `", "`")
    lines = [f"# Compression quality: {title} (reduced-scale reproduction of the study)", "",
             f"{meta['date']}, torch {meta['torch']}, {meta['cpu']}, {meta['cores']} cores; {cmd} "
             f"({wall:.0f} s for all settings run; this setting's cases trained for "
             f"{meta['train_seconds_sum']:.0f} CPU-s).", ""]
    lines += [p for para in _describe(setting, args) for p in (para, "")]
    base = {m: next(r for r in rows if r["name"] == "uncompressed")[f"{m}_plain"] for m in metrics}
    loss_name = "test loss" if setting == "cnn" else "val loss"
    head = {"acc": ("test acc %", ".2f"), "val_loss": (loss_name, ".4f")}
    cols = ["case", "act wire/raw", "grad wire/raw"]
    for m in metrics:
        for ev in ("compressed", "plain"):
            cols += [f"{head[m][0]}, {ev} eval", "Δ"] + (["ppl"] if setting != "cnn" else [])
    cols.append("train s")
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["name"], f"{r.get('act_bytes_ratio', 1):.3f}", f"{r.get('grad_bytes_ratio', 1):.3f}"]
        for m in metrics:
            for ev in ("compressed", "plain"):
                v = r[f"{m}_{ev}"]
                spec = head[m][1]
                cells += ["nan" if not math.isfinite(v) else f"{v:{spec}}", f"{v - base[m]:+{spec}}"]
                if setting != "cnn":
                    cells.append(_ppl(v))
        cells.append(str(r["train_seconds"]))
        lines.append("| " + " | ".join(cells) + " |")
    for m in metrics:
        label = "test accuracy" if m == "acc" else loss_name
        lines += ["", f"## The study's findings, checked on these numbers ({label})", ""]
        lines += [f"- {f}" for f in found[m]]
    lines += ["", "Wire/raw: payload bytes per boundary and micro-batch (`payload_nbytes`) over fp32 bytes "
              "(summed over the boundaries on the CNN). With index reuse the gradient payload carries values "
              "only. A finding's gap is how much more the case the study calls worse loses than the other "
              "case (in the metric's units).",
              "Every compressed case uses the seed-0 initialisation and batch order; the `seed+k` rows "
              "change both, and their spread is the noise a difference must exceed to count."]
    mpath = out / f"{stem}.md"
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath, checks


def write_summary(checks: dict[str, dict], args: dict, wall: float, out: Path = RESULTS,
                  machine: dict | None = None) -> Path:
    """``quality_findings.md``: one row per finding, one column per (setting, metric): where it holds."""
    cols = [(s, m) for s in SETTINGS if s in checks for m in SETTINGS[s][2]]
    short = {"acc": "test acc", "val_loss": "loss"}
    keys: list[str] = []
    cell: dict[tuple[str, str, str], str] = {}
    for s, m in cols:
        for key, text, v in checks[s][m]:
            if key not in keys:
                keys.append(key)
            gap = ""
            if "(gap " in text:  # "... (gap +0.1900 > seed noise ...)": keep "+0.1900"
                gap = text.rsplit("(gap ", 1)[-1].split(";")[0].split(" >")[0].split(" <=")[0]
            cell[(s, m, key)] = f"{v}: {gap}" if gap else v
    meta = machine or _machine()
    cmd = f"`python benchmarks/e2e/bench_quality.py {args['argv']}`".replace(" `", "`")
    lines = ["# Which of the study's findings hold in which setting", "",
             f"{meta['date']}, torch {meta['torch']}, {meta['cpu']}, {meta['cores']} cores; {cmd} "
             f"({wall:.0f} s).", "",
             "Per setting: " + "; ".join(f"[{SETTINGS[s][1]}]({SETTINGS[s][0]}.md)" for s in checks) + ".",
             "A cell gives the verdict and the gap: how much more the case the study calls worse loses "
             "than the other, in the column's metric (loss, or accuracy points). **holds**: positive gap "
             "above the uncompressed run's seed noise (the largest distance of the other seeds' runs); "
             "**within noise (same sign)**: the study's direction, too small to tell; "
             "**within noise (opposite sign)** / **no difference**: not seen, and no measurable "
             "difference the other way; "
             "**reversed**: the opposite of the study, beyond seed noise.", "",
             "| finding (the study's direction) | "
             + " | ".join(f"{SETTINGS[s][1]} ({short[m]})" for s, m in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(cell.get((s, m, key), "not run") for s, m in cols) + " |")
    lines += ["", "Seed noise per column: " + "; ".join(
        f"{SETTINGS[s][1]} ({short[m]}) {checks[s]['noise'][m]}" for s, m in cols) + "."]
    path = out / "quality_findings.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _finish(settings: list[str], rows: dict[str, list[dict]], args: dict, wall: float, out: Path,
            machine: dict | None = None) -> int:
    """Write every setting's results and the cross-setting summary; print them."""
    checks = {}
    for s in settings:
        jpath, mpath, checks[s] = write_results(s, rows[s], args, wall, out, machine)
        checks[s]["noise"] = {m: f"{seed_noise(rows[s], m):{_METRICS[m][1]}}{_METRICS[m][2]}"
                              for m in SETTINGS[s][2]}
        print(mpath.read_text())
        print(f"wrote {jpath} and {mpath}")
    spath = write_summary(checks, args, wall, out, machine)
    print(spath.read_text())
    print(f"wrote {spath}")
    return 0


def _render(settings: list[str], out: Path) -> int:
    """Re-render the markdown of recorded runs from their JSON (same rows, args, date and machine)."""
    rows, meta = {}, None
    for s in settings:
        path = out / f"{SETTINGS[s][0]}.json"
        if not path.exists():
            raise SystemExit(f"--render-only: {path} is missing; run the setting {s!r} first")
        rec = json.loads(path.read_text())
        rows[s], meta = rec["cases"], rec["meta"]
    machine = {k: meta[k] for k in ("date", "torch", "python", "cpu", "cores")}
    return _finish(settings, rows, meta["args"], meta["wall_seconds_all_settings"], out, machine)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="scratch,finetune,cnn",
                   help=f"comma-separated, from {list(SETTINGS)} (default: all)")
    p.add_argument("--steps", type=int, default=100, help="GPT from-scratch training steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3, help="GPT from-scratch and pretraining learning rate")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="stdlib text used (train + val)")
    p.add_argument("--pretrain-steps", type=int, default=400,
                   help="fine-tuning setting: steps of uncompressed pretraining")
    p.add_argument("--ft-steps", type=int, default=100, help="fine-tuning steps of every case")
    p.add_argument("--ft-lr", type=float, default=5e-4)
    p.add_argument("--ft-skip-bytes", type=int, default=250_000,
                   help="stdlib bytes skipped between the pretraining and the fine-tuning files")
    p.add_argument("--ft-bytes", type=int, default=600_000, help="stdlib bytes of the fine-tuning files")
    from quality_cnn import CNN_DEFAULTS

    for k, v in CNN_DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="cases trained at once (one thread each)")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--noise-seeds", type=int, default=2, help="extra uncompressed runs at other seeds")
    p.add_argument("--topk30", action="store_true", help="also TopK 30%% (reuse and no reuse)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: few steps and samples, 1 noise seed; results to a temp dir unless --out")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite the markdown of --settings from their recorded JSON in the results folder "
                        "(after a change of wording; nothing is trained)")
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS.relative_to(ROOT)})")
    a = p.parse_args(argv)
    if a.layers < 3:
        p.error(f"--layers={a.layers}: need at least 3 blocks for 3 boundaries")
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not settings:
        p.error(f"--settings={a.settings!r}: unknown {bad}; choose from {list(SETTINGS)}")
    if a.quick:
        a.steps, a.pretrain_steps, a.ft_steps, a.ft_bytes = 8, 16, 8, 200_000
        a.cnn_steps, a.cnn_train, a.cnn_test, a.noise_seeds = 20, 512, 256, 1
    out = RESULTS if not (a.out or a.quick) else Path(a.out or tempfile.mkdtemp(prefix="ppq_quality_quick_"))
    args = {k.replace("-", "_"): v for k, v in vars(a).items()}
    args["argv"] = " ".join(argv)
    if a.render_only:
        return _render(settings, out)
    import quality_cnn

    if "scratch" in settings or "finetune" in settings:
        check_against_reference(args)
        train, _, _ = build_token_datasets(seq_len=a.seq_len, vocab_size=a.vocab, max_bytes=a.max_bytes)
        args["train_windows"] = len(train)  # (the call also fills the tokenizer cache once for the workers)
    if "cnn" in settings:
        quality_cnn.check_cnn_reference(args)
    workdir = tempfile.TemporaryDirectory(prefix="ppq_quality_")  # the pretrained state, never committed
    if "finetune" in settings:
        prepare_finetune(args, Path(workdir.name))
    cases = {s: study_cases(a.noise_seeds, a.topk30, SETTINGS[s][3]) for s in settings}
    if a.only:
        keep = {n.strip() for n in a.only.split(",")} | {"uncompressed"}
        known = {c.name for c in next(iter(cases.values()))}
        if keep - known:
            p.error(f"--only: unknown case(s) {sorted(keep - known)}; known: {sorted(known)}")
        cases = {s: [c for c in cs if c.name in keep or c.group == "seed noise"] for s, cs in cases.items()}
    runner = {"scratch": run_case, "finetune": run_case, "cnn": quality_cnn.run_cnn_case}
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in requirements.txt
        tqdm = None
    t0 = time.perf_counter()
    rows: dict[str, dict[str, dict]] = {s: {} for s in settings}
    total = sum(len(c) for c in cases.values()) + ("finetune" in settings)
    bar = tqdm(total=total, desc="cases", unit="run") if tqdm else None
    with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=mp.get_context("spawn")) as ex:
        def submit(setting: str) -> dict:
            # TopK cases are the slowest: start them first so the workers finish together.
            first = sorted(cases[setting], key=lambda c: c.group != "topk" and c.group != "error feedback")
            extra = (setting,) if setting != "cnn" else ()
            return {ex.submit(runner[setting], c, args, *extra): setting for c in first}

        futs = {ex.submit(pretrain, args): "pretrain"} if "finetune" in settings else {}
        for s in settings:
            if s != "finetune":
                futs.update(submit(s))
        pending = set(futs)
        while pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                r, s = f.result(), futs[f]
                if s == "pretrain":  # the checkpoint is saved: the fine-tuning cases can start
                    rows["finetune"][r["name"]] = r
                    new = submit("finetune")
                    futs.update(new)
                    pending |= set(new)
                else:
                    rows[s][r["name"]] = r
                if bar:
                    bar.update()
    if bar:
        bar.close()
    workdir.cleanup()
    wall = time.perf_counter() - t0
    ordered = {s: ([rows[s]["pretrained, not fine-tuned"]] if s == "finetune" else [])
               + [rows[s][c.name] for c in cases[s]] for s in settings}
    return _finish(settings, ordered, args, wall, out)


if __name__ == "__main__":
    sys.exit(main())
