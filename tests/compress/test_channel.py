"""``compress.BoundaryChannel``: when each direction is compressed, TopK index reuse by micro-batch,
non-finite flags and stops, counters, AQ-SGD along another sample dimension, state and rollback.

Two channels, the upstream and the downstream side of one boundary, stand for two stages here (the
engines only move their payloads); ``compressed_boundary`` over a ``side="both"`` channel is the
reference they must equal.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed_ppq.compress import (
    BoundaryChannel,
    Mode,
    NonFiniteStepError,
    codec_mode,
    compressed_boundary,
    payload_nbytes,
)
from deepspeed_ppq.config import load_ppq_config

Q4 = {"method": "quant", "bits": 4}
Q8 = {"method": "quant", "bits": 8}
TOPK = {"method": "topk", "topk_ratio": 0.25}
RAW, CODEC_RAW, STATEFUL, STATELESS = None, Mode(True, True), Mode(True, False), Mode(False, False)


def _sides(ppq: dict, **kw) -> tuple[BoundaryChannel, BoundaryChannel]:
    cfg = load_ppq_config(ppq)
    return (BoundaryChannel(cfg, side="upstream", **kw), BoundaryChannel(cfg, side="downstream", **kw))


@pytest.mark.parametrize("ppq, direction, training, steps", [
    ({}, "activations", True, [RAW, RAW]),  # codec none: the tensor itself, always
    ({"activations": Q8}, "activations", False, [RAW]),  # 8 bits: evaluation raw
    ({"activations": Q4}, "activations", False, [STATELESS]),  # <= 4 bits: evaluation compressed
    ({"activations": Q4, "gradients": Q8, "warmup_steps": 2}, "activations", True, [RAW, RAW, STATEFUL]),
    ({"activations": Q4, "gradients": Q8, "warmup_steps": 2}, "gradients", True, [RAW, RAW, STATEFUL]),
    # AQ-SGD: activations through the codec raw while the buffers fill (ppq.warmup_steps included) ...
    ({"activations": Q4, "gradients": Q8, "warmup_steps": 1, "aqsgd": {"enabled": True, "warmup_steps": 2}},
     "activations", True, [CODEC_RAW, CODEC_RAW, STATEFUL]),
    # ... gradients compressed once ppq.warmup_steps is over ...
    ({"activations": Q4, "gradients": Q8, "warmup_steps": 1, "aqsgd": {"enabled": True, "warmup_steps": 2}},
     "gradients", True, [RAW, STATEFUL, STATEFUL]),
    # ... except TopK gradients reusing the activation's indices: raw through the codec (none to reuse)
    ({"activations": TOPK, "gradients": TOPK, "aqsgd": {"enabled": True, "warmup_steps": 2}},
     "gradients", True, [CODEC_RAW, CODEC_RAW, STATEFUL]),
])
def test_when_a_direction_is_compressed(ppq, direction, training, steps):
    cfg = load_ppq_config(ppq)
    got = [codec_mode(cfg, direction, training=training, step=s) for s in range(len(steps))]
    assert got == steps
    # step None is past every warm-up; the channel answers the same for both of its sides
    assert codec_mode(cfg, direction, training=training, step=None) == steps[-1]
    up, down = _sides(ppq)
    assert [up.mode(direction, training=training, step=s) for s in range(len(steps))] == steps
    assert [down.mode(direction, training=training, step=s) for s in range(len(steps))] == steps


def test_two_sides_out_of_order_equal_the_reference():
    """Activations with EF, TopK gradients reusing the activation's indices (values only): the upstream
    and downstream sides, fed out of order (F0 F1 B1 F2 B0 B2), give exactly what compressed_boundary
    gives in F0 B0 F1 B1 F2 B2 order: EF follows the activations' order, the indices their micro-batch."""
    ppq = {"activations": {**TOPK, "error_feedback": "ef"}, "gradients": TOPK}
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 16, generator=g) for _ in range(3)]
    gys = [torch.randn(2, 3, 16, generator=g) for _ in range(3)]

    ref = BoundaryChannel(load_ppq_config(ppq))
    want_y, want_gx = [], []
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_()
        y = compressed_boundary(x, ref)
        y.backward(gy)
        want_y.append(y.detach())
        want_gx.append(x.grad)

    up, down = _sides(ppq)
    got_y, got_gx = {}, {}

    def forward(m):
        got_y[m] = down.recv("activations", up.send("activations", xs[m], micro_batch=m), xs[m].shape,
                             xs[m].dtype, micro_batch=m)

    def backward(m):
        wire = down.send("gradients", gys[m], micro_batch=m)
        assert wire.numel() == payload_nbytes(load_ppq_config(ppq).gradients, (2, 3, 16), torch.float32,
                                              values_only=True)
        got_gx[m] = up.recv("gradients", wire, gys[m].shape, gys[m].dtype, micro_batch=m)

    for op, m in [(forward, 0), (forward, 1), (backward, 1), (forward, 2), (backward, 0), (backward, 2)]:
        op(m)
    for m in range(3):
        assert torch.equal(got_y[m], want_y[m]) and torch.equal(got_gx[m], want_gx[m]), m
    assert up.stats["activations"]["wire_bytes"] == ref.stats["activations"]["wire_bytes"]
    assert down.stats["gradients"]["wire_bytes"] == ref.stats["gradients"]["wire_bytes"]


def test_a_gradient_needs_its_activation_first():
    up, down = _sides({"activations": TOPK, "gradients": TOPK})
    down.recv("activations", up.send("activations", torch.randn(2, 8), micro_batch=0), (2, 8), torch.float32,
              micro_batch=0)
    with pytest.raises(RuntimeError, match=r"gradients\[0\]: no TopK indices are kept for micro-batch 7"):
        down.send("gradients", torch.randn(2, 8), micro_batch=7)
    down.send("gradients", torch.randn(2, 8), micro_batch=0)  # the kept one


def test_flagged_activation_gives_a_flagged_gradient_of_the_agreed_size():
    up, down = _sides({"activations": TOPK, "gradients": TOPK, "nonfinite": "skip"})
    x = torch.randn(2, 16)
    x[1, 3] = float("inf")
    y = down.recv("activations", up.send("activations", x, micro_batch=0), x.shape, x.dtype, micro_batch=0)
    assert torch.isnan(y).all()
    wire = down.send("gradients", torch.randn(2, 16), micro_batch=0)  # no indices to reuse
    assert wire.numel() == down.nbytes("gradients", (2, 16), torch.float32)
    assert torch.isnan(up.recv("gradients", wire, (2, 16), torch.float32, micro_batch=0)).all()
    assert up.flagged == ["stage 0, boundary 0 (stage 0 -> 1) activations[0]",
                          "stage 0, boundary 0 (stage 0 -> 1) gradients[0]"]
    assert down.flagged[0] == "stage 1, boundary 0 (stage 0 -> 1) activations[0]"
    up.raise_if_flagged(step=0)  # "skip": the engine skips the step, nothing raises
    for ch in (up, down):
        ch.clear_flags()
        assert ch.flagged == []


def test_nonfinite_error_stops_the_receiver_at_once_and_the_sender_after_its_message():
    up, down = _sides({"activations": Q8, "gradients": Q8, "nonfinite": "error"})
    x = torch.randn(2, 16)
    x[0, 0] = float("nan")
    wire = up.send("activations", x, step=3)  # the flagged payload is made, not raised on
    flushed = []
    with pytest.raises(NonFiniteStepError, match=r"NaN/Inf to send at stage 0, boundary 0 \(stage 0 -> 1\) "
                                                 r"activations\[0\] \(step 3\).*ppq.nonfinite='skip'"):
        up.raise_if_flagged(3, flush=lambda: flushed.append(True))
    assert flushed == [True]  # the message went out first, so the receiver stops too
    with pytest.raises(NonFiniteStepError, match=r"NaN/Inf received at stage 1, boundary 0"):
        down.recv("activations", wire, x.shape, x.dtype, step=3)


def test_tensors_on_the_frameworks_own_path_are_counted_and_checked():
    up, down = _sides({"activations": Q8, "gradients": Q8, "warmup_steps": 1, "nonfinite": "skip"})
    x = torch.randn(2, 4, 8)
    assert up.send("activations", x, step=0) is x  # warm-up: the tensor itself
    assert down.recv("activations", x, x.shape, x.dtype, step=0) is x
    up.passed_plain("activations", (x, torch.arange(2)), sent=True, step=0)  # an integer tensor: side bytes
    st = up.stats["activations"]
    assert (st["raw_bytes"], st["wire_bytes"], st["side_bytes"], st["messages"]) == (512, 512, 16, 2)
    assert down.stats["activations"]["raw_bytes"] == 0  # a receiver counts nothing but decode time
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    down.passed_plain("activations", (bad,), sent=False, step=0)
    assert down.flagged == ["stage 1, boundary 0 (stage 0 -> 1) activations[0]"]
    none_up, _ = _sides({})
    none_up.passed_plain("activations", (bad,), sent=True)  # codec none everywhere: stock, unchecked
    assert none_up.flagged == []


def test_counters_sender_bytes_and_encode_time_receiver_decode_time():
    up, down = _sides({"activations": Q4, "gradients": Q8})
    x = torch.randn(4, 8, 32)
    for m in range(3):
        down.recv("activations", up.send("activations", x, micro_batch=m), x.shape, x.dtype, micro_batch=m)
    sent, got = up.stats["activations"], down.stats["activations"]
    payload = payload_nbytes(load_ppq_config({"activations": Q4}).activations, x.shape, x.dtype)
    assert (sent["raw_bytes"], sent["wire_bytes"], sent["messages"]) == (3 * x.nbytes, 3 * payload, 3)
    assert sent["encode_s"] > 0 and sent["decode_s"] == 0
    assert got["decode_s"] > 0 and (got["raw_bytes"], got["wire_bytes"], got["messages"]) == (0, 0, 0)


def test_aqsgd_along_the_batch_dimension_of_seq_batch_hidden():
    """sample_dim=1 ([seq, batch, hidden], megatron-core) keeps the same per-sample buffers as sample_dim=0
    on the transposed tensor: the decoded activations are the same, transposed."""
    ppq = {"activations": {**Q4, "bits": 2}, "aqsgd": {"enabled": True}}
    seq_first = BoundaryChannel(load_ppq_config(ppq), sample_dim=1)
    batch_first = BoundaryChannel(load_ppq_config(ppq))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(5, 6, 8, generator=g)  # 5 samples of [seq 6, hidden 8]
    for step in range(4):
        ids = torch.tensor([(2 * step + j) % 5 for j in range(3)])
        xb = pool[ids] + 0.05 * step  # [batch, seq, hidden]
        xs = xb.transpose(0, 1).contiguous()  # [seq, batch, hidden]
        ys = compressed_boundary(xs, seq_first, sample_ids=ids)
        yb = compressed_boundary(xb, batch_first, sample_ids=ids)
        assert torch.equal(ys, yb.transpose(0, 1)), step
    with pytest.raises(ValueError, match=r"2 sample_ids for a message of 3 samples \(shape \(6, 3, 8\), "
                                         r"sample_dim=1\)"):
        compressed_boundary(xs, seq_first, sample_ids=ids[:2])


def test_state_dict_resumes_a_side_exactly():
    ppq = {"activations": Q4, "gradients": {**Q8, "error_feedback": "ef21"}, "aqsgd": {"enabled": True}}
    up, down = _sides(ppq)
    g = torch.Generator().manual_seed(0)
    msgs = [(torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g), torch.tensor([m % 3, 5]))
            for m in range(6)]

    def run(up, down, part):
        out = []
        for m, (x, gy, ids) in part:
            w = up.send("activations", x, micro_batch=m, sample_ids=ids)
            out.append(down.recv("activations", w, x.shape, x.dtype, micro_batch=m, sample_ids=ids))
            out.append(up.recv("gradients", down.send("gradients", gy, micro_batch=m), gy.shape, gy.dtype,
                               micro_batch=m))
        return out

    first = run(up, down, list(enumerate(msgs))[:3])
    saved_up, saved_down = up.state_dict(), down.state_dict()
    cont = run(up, down, list(enumerate(msgs))[3:])
    up2, down2 = _sides(ppq)
    up2.load_state_dict(saved_up)
    down2.load_state_dict(saved_down)
    assert all(torch.equal(a, b) for a, b in zip(cont, run(up2, down2, list(enumerate(msgs))[3:])))
    assert up2.stats["activations"]["messages"] == 6 and first
    with pytest.raises(ValueError, match="the upstream side does not recv activations"):
        up2.load_state_dict(saved_down)


def test_rollback_returns_the_codec_state_to_the_start_of_the_step():
    ppq = {"activations": {**Q4, "error_feedback": "ef"}, "gradients": Q8, "aqsgd": {"enabled": False}}
    ch = BoundaryChannel(load_ppq_config(ppq))
    x = torch.randn(2, 16, requires_grad=True)
    compressed_boundary(x, ch).sum().backward()
    before = ch.state_dict()["sides"]
    ch.begin_step()
    compressed_boundary(x * 3, ch).sum().backward()
    assert not torch.equal(ch.state_dict()["sides"]["send|activations|0"]["feedback"],
                           before["send|activations|0"]["feedback"])
    ch.rollback()
    after = ch.state_dict()["sides"]
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k][f], before[k][f]) for k in before for f in before[k])


def test_bad_arguments_are_named():
    cfg = load_ppq_config({"activations": Q4})
    with pytest.raises(ValueError, match="side='middle': use 'upstream', 'downstream' or 'both'"):
        BoundaryChannel(cfg, side="middle")
    with pytest.raises(ValueError, match="direction='acts': use 'activations' or 'gradients'"):
        BoundaryChannel(cfg).mode("acts")
    with pytest.raises(ValueError, match="the downstream side does not send activations"):
        BoundaryChannel(cfg, side="downstream").send("activations", torch.randn(2, 4))
    with pytest.raises(ValueError, match="needs a BoundaryChannel.*side='both'"):
        compressed_boundary(torch.randn(2, 4), BoundaryChannel(cfg, side="upstream"))


@pytest.mark.parametrize("codec", [TOPK, Q8])
def test_a_payload_received_as_another_dtype_is_an_error_naming_both(codec):
    """fp16 sent, bf16 expected: the payload sizes agree, the header's dtype byte does not."""
    ch = BoundaryChannel(load_ppq_config({"activations": codec}))
    wire = ch.send("activations", torch.randn(2, 64, dtype=torch.float16), micro_batch=0)
    with pytest.raises(ValueError, match=r"encoded from torch.float16, the receiver decodes it as torch.bf"):
        ch.recv("activations", wire, (2, 64), torch.bfloat16, micro_batch=0)
