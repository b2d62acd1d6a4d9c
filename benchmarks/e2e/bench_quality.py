"""Reduced-scale reproduction of the activation/gradient compression study on the small GPT.

The study (see /work/shared/notes/method.md and docs/method.md) compressed activations and gradients at
the 3 boundaries of a 4-stage pipeline, simulated in one process. This benchmark does the same: the
small GPT (``deepspeed_ppq.models``) is trained from scratch on the stdlib text, with
``compressed_boundary`` (the single-process reference that the distributed engines must match)
inserted after blocks n/4, n/2 and 3n/4. Every case trains on the same batches from the same
initialisation; each trained model is evaluated twice, with compression on (codec in eval mode) and
off, and compared with the uncompressed run.

Cases: the uncompressed run at 3 seeds (its seed-to-seed spread is the noise every difference is
judged against); bits a8/g8, a4/g8, a8/g4, a4/g6, a4/g4, a2/g8, a8/g2 (per-token scales); per-sample
scales (the study's granularity) at a4/g8, a8/g4, a2/g8 and a8/g2; TopK 50% and 10% with index reuse
and with independent gradient indices (``--topk30`` adds 30%); TopK 10% with EF and EF21; AQ-SGD at a2/g8.

    python benchmarks/e2e/bench_quality.py               # ~11 min on 2 shared cores (2 cases at a time)
    python benchmarks/e2e/bench_quality.py --steps 400   # longer training, clearer gaps

Results: benchmarks/results/quality_small_gpt.{json,md}.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deepspeed_ppq.config import AQSGDConfig, CodecConfig  # noqa: E402
from deepspeed_ppq.data import build_token_datasets  # noqa: E402
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


def study_cases(noise_seeds: int = 2, topk30: bool = False) -> list[Case]:
    """The study's cases; ``noise_seeds`` extra uncompressed runs at seeds --seed+1, --seed+2, ..."""
    cases = [Case("uncompressed", "baseline")]
    cases += [Case(f"uncompressed seed+{k}", "seed noise", seed=k) for k in range(1, noise_seeds + 1)]
    for a, g in [(8, 8), (4, 8), (8, 4), (4, 6), (4, 4), (2, 8), (8, 2)]:
        cases.append(Case(f"a{a}/g{g}", "bits (per-token scales)", _q(a), _q(g)))
    # per-sample scales: the study's granularity (one min-max scale per vector)
    for a, g in [(4, 8), (8, 4), (2, 8), (8, 2)]:
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
    """A pipeline boundary in one process: activations compressed forward, gradients backward.

    At evaluation ``compress`` picks between the activation codec (stateless, as the engines run it
    when ``compress_eval`` is on) and no codec at all, whatever the config's default.
    """

    def __init__(self, name: str, act: CodecConfig, grad: CodecConfig, aqsgd: AQSGDConfig | None):
        super().__init__()
        from deepspeed_ppq.compress import BoundaryDecoder, BoundaryEncoder

        self.name = name
        self.act, self.grad = act, grad
        self.enabled = act.enabled or grad.enabled
        self.act_enc = BoundaryEncoder(act, name=f"{name}.act", aqsgd=aqsgd)
        self.act_dec = BoundaryDecoder(act, name=f"{name}.act", aqsgd=aqsgd)
        self.grad_enc = BoundaryEncoder(grad, name=f"{name}.grad", direction="gradients")
        self.grad_dec = BoundaryDecoder(grad, name=f"{name}.grad", direction="gradients")
        eval_act = act.model_copy(update={"compress_eval": True})
        self.eval_enc = BoundaryEncoder(eval_act, name=f"{name}.act.eval")
        self.eval_dec = BoundaryDecoder(eval_act, name=f"{name}.act.eval")
        self.compress = True
        self.sample_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_ppq.compress import compressed_boundary

        if not self.enabled:
            return x
        if self.training:
            return compressed_boundary(x, self.act_enc, self.act_dec, self.grad_enc, self.grad_dec,
                                       sample_ids=self.sample_ids, training=True)
        if not (self.compress and self.act.enabled):
            return x
        return compressed_boundary(x, self.eval_enc, self.eval_dec, None, None, training=False)


def boundary_positions(n_layers: int, stages: int = 4) -> list[int]:
    """Indices into ``gpt_layers`` after which a boundary sits: after blocks n/4, n/2, 3n/4 (4 stages)."""
    return [round(n_layers * s / stages) for s in range(1, stages)]  # layer 0 is the embedding


def build_model(cfg: GPTConfig, case: Case, seed: int) -> tuple[nn.Sequential, list[Boundary]]:
    act = CodecConfig(**case.act)
    grad = CodecConfig(**case.grad)
    aq = AQSGDConfig(enabled=True) if case.aqsgd else None
    layers, bounds = [], []
    cuts = set(boundary_positions(cfg.n_layers))
    for i, layer in enumerate(gpt_layers(cfg, seed)):
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


def run_case(case: Case, args: dict) -> dict:
    """Train one case and evaluate it with and without compression (runs in a worker process)."""
    torch.set_num_threads(1)
    train, val, _ = build_token_datasets(seq_len=args["seq_len"], vocab_size=args["vocab"],
                                         max_bytes=args["max_bytes"])
    cfg = GPTConfig(vocab_size=args["vocab"], seq_len=args["seq_len"], d_model=args["d_model"],
                    n_heads=args["heads"], n_layers=args["layers"])
    seed = args["seed"] + (case.seed or 0)
    model, bounds = build_model(cfg, case, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
    warm = max(1, args["steps"] // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args["steps"]) /
                                                                       args["steps"])))
    gen = torch.Generator().manual_seed(seed)
    # Samples come round once per epoch (AQ-SGD sees each sample repeatedly only then).
    order = torch.cat([torch.randperm(len(train), generator=gen) for _ in range(
        (args["steps"] * args["batch"]) // len(train) + 1)])
    t0 = time.perf_counter()
    losses, nonfinite = [], False
    for step in range(args["steps"]):
        idx = order[step * args["batch"]:(step + 1) * args["batch"]]
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
    train_s = time.perf_counter() - t0
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


def seed_noise(rows: list[dict]) -> float:
    """Largest distance of an uncompressed noise run's validation loss from the seed-0 run's (nan if none)."""
    base = next(r for r in rows if r["name"] == "uncompressed")["val_loss_plain"]
    spread = [abs(r["val_loss_plain"] - base) for r in rows if r["group"] == "seed noise"]
    return max(spread) if spread else float("nan")


def findings(rows: list[dict]) -> list[str]:
    """The study's directions, each checked on the measured numbers (reported whatever they show).

    A direction "holds" when the measured gap has the study's sign and exceeds the seed noise of the
    uncompressed run; with the right sign but a smaller gap it is "same direction, within seed noise".
    """
    by = {r["name"]: r for r in rows}
    base = by["uncompressed"]["val_loss_plain"]
    noise = seed_noise(rows)

    def d(name: str, key: str = "val_loss_compressed") -> float:
        return by[name][key] - base if name in by else float("nan")

    def verdict(worse: float, better: float) -> str:
        """The study says ``worse`` > ``better``."""
        if not (math.isfinite(worse) and math.isfinite(better)):
            return "not measured (case missing or diverged)"
        gap = worse - better
        if gap > 0 and (not math.isfinite(noise) or gap > noise):
            return f"holds (gap {gap:+.4f} > seed noise {noise:.4f})"
        if gap > 0:
            return f"same direction, within seed noise (gap {gap:+.4f} <= {noise:.4f})"
        return f"does NOT hold (gap {gap:+.4f}; seed noise {noise:.4f})"

    out = [f"seed noise (uncompressed, largest |Δ| over {sum(r['group'] == 'seed noise' for r in rows)} "
           f"other seeds): {noise:.4f}"]
    for bits in (4, 2):
        for tag, sfx in (("per-token", ""), ("per-sample", " per-sample")):
            n_a, n_g = f"a{bits}/g8{sfx}", f"a8/g{bits}{sfx}"
            if n_a in by and n_g in by:
                ga, gg = d(n_a), d(n_g)
                out.append(f"gradients more sensitive than activations ({bits} bits, {tag} scales, swapped): "
                           f"Δ {n_g} = {gg:+.4f}, Δ {n_a} = {ga:+.4f} -> {verdict(gg, ga)}")
    g8, g6, g4 = (d(n) for n in ("a4/g8", "a4/g6", "a4/g4"))
    out.append(f"fewer gradient bits cost more: Δ a4/g8, a4/g6, a4/g4 = {g8:+.4f}, {g6:+.4f}, {g4:+.4f} -> "
               f"g4 vs g8: {verdict(g4, g8)}; g6 vs g8: {verdict(g6, g8)}")
    for pct in (50, 10):
        r, nr = d(f"top{pct}% reuse"), d(f"top{pct}% no reuse")
        out.append(f"TopK{pct}% without index reuse worse: Δ reuse = {r:+.4f}, no reuse = {nr:+.4f} -> "
                   f"{verdict(nr, r)}")
    ts, tp = d("top10% reuse"), d("top10% reuse", "val_loss_plain")
    out.append(f"a TopK-trained model needs TopK at evaluation: Δ top10% with it = {ts:+.4f}, "
               f"without = {tp:+.4f} -> {verdict(tp, ts)}")
    qs, qp = d("a2/g8"), d("a2/g8", "val_loss_plain")
    out.append(f"2-bit activations need compression at evaluation: Δ a2/g8 with it = {qs:+.4f}, "
               f"without = {qp:+.4f} -> {verdict(qp, qs)}")
    for bits in (4, 2):
        s, t = d(f"a{bits}/g8 per-sample"), d(f"a{bits}/g8")
        out.append(f"per-token scales beat per-sample at a{bits}/g8: Δ per-sample = {s:+.4f}, "
                   f"per-token = {t:+.4f} -> {verdict(s, t)}")
    for ef in ("EF", "EF21"):
        n = f"top10% reuse + {ef}"
        if n in by:
            gap_ef = d(n, "val_loss_plain") - d(n)
            gap = d("top10% reuse", "val_loss_plain") - d("top10% reuse")
            out.append(f"{ef} narrows the with/without-compression evaluation gap: gap {gap_ef:+.4f} vs "
                       f"{gap:+.4f} without feedback -> {verdict(gap, gap_ef)}")
    return out


def write_results(rows: list[dict], args: dict, wall: float) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    cpu = "unknown"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "cpu": cpu, "cores": os.cpu_count(), "args": args,
            "wall_seconds": round(wall, 1),
            "boundaries_after_layers": boundary_positions(args["layers"])}
    found = findings(rows)
    jpath = RESULTS / "quality_small_gpt.json"
    jpath.write_text(json.dumps({"meta": meta, "findings": found, "cases": rows}, indent=1))
    base = next(r for r in rows if r["name"] == "uncompressed")["val_loss_plain"]
    lines = [
        "# Compression quality on the small GPT (reduced-scale reproduction of the study)",
        "",
        f"{meta['date']}, torch {meta['torch']}, {cpu}, {meta['cores']} cores; "
        f"`python benchmarks/e2e/bench_quality.py {args['argv']}`".rstrip() + f" ({wall:.0f} s).",
        f"GPT d={args['d_model']}, {args['layers']} blocks, {args['heads']} heads, seq {args['seq_len']}, "
        f"BPE vocab {args['vocab']}; trained from scratch for {args['steps']} steps of {args['batch']} "
        f"sequences (AdamW lr {args['lr']}, warm-up + cosine), seed {args['seed']}; compressed boundaries "
        f"after layers {meta['boundaries_after_layers']} of the layer list (3 boundaries of a 4-stage "
        "pipeline). Validation: held-out stdlib files. Δ = validation loss minus the uncompressed run's.",
        "",
        "| case | act wire/raw | grad wire/raw | val loss, compressed eval | Δ | ppl | "
        "val loss, plain eval | Δ | ppl | train s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vc, vp = r["val_loss_compressed"], r["val_loss_plain"]
        lines.append(
            f"| {r['name']} | {r.get('act_bytes_ratio', 1):.3f} | {r.get('grad_bytes_ratio', 1):.3f} | "
            f"{_fmt(vc)} | {vc - base:+.4f} | {_ppl(vc)} | {_fmt(vp)} | {vp - base:+.4f} | {_ppl(vp)} | "
            f"{r['train_seconds']} |")
    lines += ["", "## The study's findings, checked on these numbers", ""] + [f"- {f}" for f in found]
    lines += ["", "Wire/raw: payload bytes per boundary and micro-batch (`payload_nbytes`) over fp32 bytes. "
              "With index reuse the gradient payload carries values only.",
              f"Epochs: {args['steps'] * args['batch'] / args['train_windows']:.2f} over "
              f"{args['train_windows']} training windows. AQ-SGD sends the change of a sample's "
              "activation since the sample was last seen, so it differs from its plain codec only "
              "once samples come round again (from the second epoch on).",
              "Every compressed case uses the seed-0 initialisation and batch order; the `seed+k` rows "
              "change both, and their spread is the noise a difference must exceed to count."]
    mpath = RESULTS / "quality_small_gpt.md"
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="stdlib text used (train + val)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="cases trained at once (one thread each)")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--noise-seeds", type=int, default=2, help="extra uncompressed runs at other seeds")
    p.add_argument("--topk30", action="store_true", help="also TopK 30%% (reuse and no reuse)")
    a = p.parse_args(argv)
    if a.layers < 3:
        p.error(f"--layers={a.layers}: need at least 3 blocks for 3 boundaries")
    args = {k.replace("-", "_"): v for k, v in vars(a).items()}
    args["argv"] = " ".join(argv)
    check_against_reference(args)
    train, _, _ = build_token_datasets(seq_len=a.seq_len, vocab_size=a.vocab, max_bytes=a.max_bytes)
    args["train_windows"] = len(train)  # (the call also fills the tokenizer cache once for the workers)
    cases = study_cases(a.noise_seeds, a.topk30)
    if a.only:
        keep = {n.strip() for n in a.only.split(",")} | {"uncompressed"}
        unknown = keep - {c.name for c in cases}
        if unknown:
            p.error(f"--only: unknown case(s) {sorted(unknown)}; known: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in keep or c.group == "seed noise"]
    t0 = time.perf_counter()
    rows: dict[str, dict] = {}
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in requirements.txt
        tqdm = None
    with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=mp.get_context("spawn")) as ex:
        # TopK cases are the slowest: start them first so the two workers finish together.
        first = sorted(cases, key=lambda c: c.group != "topk" and c.group != "error feedback")
        futs = {ex.submit(run_case, c, args): c for c in first}
        it = cf.as_completed(futs)
        bar = tqdm(it, total=len(futs), desc="cases", unit="run") if tqdm else it
        for f in bar:
            r = f.result()
            rows[r["name"]] = r
    wall = time.perf_counter() - t0
    ordered = [rows[c.name] for c in cases]
    jpath, mpath = write_results(ordered, args, wall)
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
