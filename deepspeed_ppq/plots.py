"""The demo's outputs: the markdown report, a Perfetto trace of the measured runs, and PNG plots
(loss curves, per-stage timeline, memory by category). Inputs are the plans and the per-rank results
that ``deepspeed_ppq.demo`` collects; nothing here runs training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["write_outputs", "run_summary", "chrome_trace"]

_COMM = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
_COLORS = {"ForwardPass": "#4C72B0", "BackwardPass": "#55A868", "SendActivation": "#C44E52",
           "RecvActivation": "#DD8452", "SendGrad": "#8172B3", "RecvGrad": "#937860",
           "OptimizerStep": "#DA8BC3", "ReduceGrads": "#8C8C8C", "LoadMicroBatch": "#CCB974",
           "ReduceTiedGrads": "#64B5CD"}
_MIB = 2**20


def run_summary(plan, ranks: list[dict], settings: dict) -> dict:
    """Measured and predicted figures of one run (``ranks``: the per-rank results, stage order)."""
    ranks = sorted(ranks, key=lambda r: r["stage"])
    step = max(r["step_time_median"] for r in ranks)
    gb = ranks[0]["global_batch"]
    stages = []
    for r, sp in zip(ranks, plan.stages):
        # instruction times are means over the traced (last) steps: divide by those steps' mean time
        steps = len(r["step_times"])
        traced = r["step_times"][max(1, steps - 3):] or r["step_times"]
        t_step = sum(traced) / len(traced)
        comm = sum(v for k, v in r["per_instruction_s"].items() if k in _COMM)
        compute = sum(r["per_instruction_s"].get(k, 0.0) for k in ("ForwardPass", "BackwardPass"))
        led = r["memory"]["ledger"]["groups"]
        growth = r["memory"]["peak_rss"] - r["memory"]["rss_before_model"]
        stages.append({"stage": r["stage"], "layers": [r["parts"][r["stage"]], r["parts"][r["stage"] + 1]],
                       "idle_fraction": comm / t_step if t_step else 0.0,
                       "non_compute_fraction": max(0.0, 1 - compute / t_step) if t_step else 0.0,
                       "predicted_memory": dict(sp.memory), "measured_ledger": led,
                       "peak_rss_growth": growth, "formats": sp.formats})
    # Bytes between the stages per optimizer step: the engine's counters (summed over the stages).
    wire = ranks[0]["wire"]
    steps = len(ranks[0]["losses"])
    m = settings["model"]
    raw_per_dir = ranks[0]["micro_batch"] * m["seq_len"] * m["d_model"] * 4 * ranks[0]["micro_batches"]
    counted = {k: v for k, v in wire.items() if v.get("messages", 0) > 0}
    if counted:
        wire_step = sum(v["wire_bytes"] + v.get("side_bytes", 0) for v in counted.values()) / steps
        raw_step = sum(v["raw_bytes"] for v in counted.values()) / steps
        source = "engine counters (ppq_stats)"
    else:
        wire_step = raw_step = 2 * raw_per_dir * (len(ranks) - 1)
        source = "computed from the tensor shapes (the engine counts only compressed traffic)"
    val = ranks[-1]["val_loss"]
    return {"step_time": step, "samples_per_s": gb / step, "global_batch": gb,
            "micro_batch": ranks[0]["micro_batch"], "micro_batches": ranks[0]["micro_batches"],
            "bubble_measured": sum(s["idle_fraction"] for s in stages) / len(stages),
            "non_compute_measured": sum(s["non_compute_fraction"] for s in stages) / len(stages),
            "bubble_predicted": plan.predicted_bubble_fraction,
            "step_time_predicted": plan.predicted_step_time,
            "val_loss": val, "val_ppl": math.exp(val) if val < 50 else float("inf"),
            "train_loss_last": ranks[-1]["losses"][-1], "wire_bytes_per_step": wire_step,
            "raw_bytes_per_step": raw_step, "bytes_source": source, "stages": stages,
            "activation_codec": plan.activation_codec, "gradient_codec": plan.gradient_codec,
            "optimizer_8bit": plan.optimizer_8bit, "recompute": [s.recompute for s in plan.stages],
            "weight_formats": sorted({f for s in plan.stages for f in s.formats})}


def chrome_trace(runs: dict[str, list[dict]]) -> dict:
    """Perfetto/Chrome trace: one process per run, one thread per stage; measured instruction spans."""
    events = []
    for pid, (name, ranks) in enumerate(runs.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{name} (measured)"}})
        for r in ranks:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r["stage"],
                           "args": {"name": f"stage {r['stage']}"}})
            for ev, a, b in r["events"]:
                events.append({"ph": "X", "name": ev, "pid": pid, "tid": r["stage"], "ts": a * 1e6,
                               "dur": max(0.0, (b - a) * 1e6),
                               "cat": "comm" if ev in _COMM else "compute"})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _plots(out: Path, runs: dict[str, list[dict]], summaries: dict[str, dict],
           budget_mib: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ranks in runs.items():
        losses = ranks[-1]["losses"]
        samples = [(i + 1) * ranks[-1]["global_batch"] for i in range(len(losses))]
        ax.plot(samples, losses, label=f"{name} (val {summaries[name]['val_loss']:.3f})")
    ax.set_xlabel("training samples")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves (same samples, same order)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    written.append("loss.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 1.1 * sum(len(r) for r in runs.values())),
                             squeeze=False)
    for ax, (name, ranks) in zip(axes[:, 0], runs.items()):
        for r in ranks:
            for ev, a, b in r["events"]:
                ax.barh(r["stage"], (b - a) * 1e3, left=a * 1e3, color=_COLORS.get(ev, "#333333"),
                        edgecolor="none")
        ax.set_yticks([r["stage"] for r in ranks], [f"stage {r['stage']}" for r in ranks])
        ax.invert_yaxis()
        ax.set_title(f"{name}: measured instructions, last steps "
                     f"(bubble {summaries[name]['bubble_measured']:.0%})")
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    written.append("timeline.png")

    cats = ["weights", "master", "gradients", "optimizer", "activations", "buffers"]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, x = [], 0
    for name, s in summaries.items():
        for st in s["stages"]:
            bottom = 0.0
            for i, c in enumerate(cats):
                v = st["predicted_memory"].get(c, 0) / _MIB
                ax.bar(x, v, bottom=bottom, color=f"C{i}", label=c if x == 0 else None)
                bottom += v
            measured = sum(st["measured_ledger"].values()) / _MIB
            ax.plot([x - 0.4, x + 0.4], [measured] * 2, color="black", lw=2,
                    label="measured weights+optimizer(+grads)" if x == 0 else None)
            labels.append(f"{name}\nstage {st['stage']}")
            x += 1
    ax.axhline(budget_mib, color="red", ls="--", label="budget")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("MiB")
    ax.set_title("Per-stage memory by category (bars: predicted peak)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    written.append("memory.png")
    return written


def _mib(n: float) -> str:
    return f"{n / _MIB:.2f}"


def write_outputs(out: Path, settings: dict, tuned: dict, runs: dict[str, list[dict]], wall: float) -> str:
    """Write report.md, summary.json, trace.json and the PNGs to ``out``; returns the report text."""
    out = Path(out)
    summaries = {name: run_summary(tuned[name], ranks, settings) for name, ranks in runs.items()}
    (out / "summary.json").write_text(json.dumps({"settings": settings, "budget": tuned["budget"],
                                                  "runs": summaries}, indent=1, default=str))
    (out / "trace.json").write_text(json.dumps(chrome_trace(runs)))
    pngs = _plots(out, runs, summaries, tuned["budget"] / _MIB)
    b, t = summaries["baseline"], summaries["tuned"]
    m = settings["model"]
    lines = [
        "# ppq demo: stock DeepSpeed pipeline vs the ppq-tuned plan",
        "",
        f"Small GPT: {m['n_layers']} blocks, d={m['d_model']}, {m['n_heads']} heads, seq {m['seq_len']}, "
        f"BPE vocab {m['vocab_size']} on the Python stdlib text; {settings['stages']} pipeline stages "
        f"(deepspeed launcher); both runs train {settings['train_steps']} steps x global batch "
        f"{settings['global_batch']} on the same samples in the same order. Per-stage memory budget "
        f"{_mib(tuned['budget'])} MiB ({tuned['budget_note']}). Total wall time {wall:.0f} s.",
        "",
        "| | baseline | tuned | tuned / baseline |",
        "|---|---|---|---|",
        f"| samples/s (measured) | {b['samples_per_s']:.2f} | {t['samples_per_s']:.2f} | "
        f"{t['samples_per_s'] / b['samples_per_s']:.2f}x |",
        f"| step time s, measured (predicted) | {b['step_time']:.3f} ({b['step_time_predicted']:.3f}) | "
        f"{t['step_time']:.3f} ({t['step_time_predicted']:.3f}) | {t['step_time'] / b['step_time']:.2f} |",
        f"| bubble: measured idle in send/recv (predicted) | {b['bubble_measured']:.1%} "
        f"({b['bubble_predicted']:.1%}) | {t['bubble_measured']:.1%} ({t['bubble_predicted']:.1%}) | "
        f"{t['bubble_measured'] / max(b['bubble_measured'], 1e-9):.2f} |",
        f"| not computing: 1 - (forward + backward) / step | {b['non_compute_measured']:.1%} | "
        f"{t['non_compute_measured']:.1%} | "
        f"{t['non_compute_measured'] / max(b['non_compute_measured'], 1e-9):.2f} |",
        f"| micro-batch x count | {b['micro_batch']} x {b['micro_batches']} | "
        f"{t['micro_batch']} x {t['micro_batches']} | |",
        f"| activation recomputation per stage | {b['recompute']} | {t['recompute']} | |",
        f"| weight formats / 8-bit optimizer | {b['weight_formats']} / {b['optimizer_8bit']} | "
        f"{t['weight_formats']} / {t['optimizer_8bit']} | |",
        f"| codecs act / grad | {json.dumps(b['activation_codec'])} / {json.dumps(b['gradient_codec'])} | "
        f"{json.dumps(t['activation_codec'])} / {json.dumps(t['gradient_codec'])} | |",
        f"| bytes between stages per step (MiB) | {_mib(b['wire_bytes_per_step'])} | "
        f"{_mib(t['wire_bytes_per_step'])} | {t['wire_bytes_per_step'] / b['wire_bytes_per_step']:.3f} |",
        f"| validation loss (perplexity) | {b['val_loss']:.4f} ({b['val_ppl']:.1f}) | "
        f"{t['val_loss']:.4f} ({t['val_ppl']:.1f}) | {t['val_loss'] - b['val_loss']:+.4f} |",
        "",
        "## Per-stage memory (MiB): predicted peak by category, measured storage",
        "",
        "| run | stage | layers | predicted total | predicted weights / master / grads / optimizer / "
        "activations / buffers | measured storage (ledger) | peak RSS growth |",
        "|---|---|---|---|---|---|---|",
    ]
    cats = ["weights", "master", "gradients", "optimizer", "activations", "buffers"]
    for name, s in summaries.items():
        for st in s["stages"]:
            pm = st["predicted_memory"]
            lines.append(
                f"| {name} | {st['stage']} | {st['layers']} | {_mib(sum(pm.values()))} | "
                + " / ".join(_mib(pm.get(c, 0)) for c in cats)
                + f" | {_mib(sum(st['measured_ledger'].values()))} "
                f"({', '.join(f'{k} {_mib(v)}' for k, v in st['measured_ledger'].items())}) | "
                f"{_mib(st['peak_rss_growth'])} |")
    lines += [
        "",
        "Bubble (measured): time each stage spends inside send/recv instructions (waiting for its "
        "peer plus the transfer) over the step time, averaged over stages, from the last traced steps. "
        "It misses waits hidden in other instructions: DeepSpeed's OptimizerStep all-reduces the gradient "
        "norm over the pipeline group, so the stage that finishes first waits there. 'Not computing' "
        "counts everything but ForwardPass and BackwardPass (the optimizer's own work included), an "
        "upper bound of the idle share. "
        f"Bytes between stages: {b['bytes_source']} (baseline); {t['bytes_source']} (tuned).",
        "Measured storage: `deepspeed_ppq.quant.measure_storage` on the live engine after training "
        "(weights, master weights, optimizer states; gradients are freed after each step). Peak RSS "
        "growth: the process's high-water mark above its size before the model was built (includes "
        "activations, communication buffers and allocator slack).",
        "",
        "Files: " + ", ".join(["report.md", "summary.json", "trace.json (open in ui.perfetto.dev)",
                               "plan_baseline.json", "plan_tuned.json", "profile.json",
                               "ds_baseline.json", "ds_tuned.json", "train.log", *pngs]),
    ]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text
