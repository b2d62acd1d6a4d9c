"""The small GPT (deepspeed_ppq.models): its pipeline layers are the sequential reference model, causal,
and a bad shape is refused."""

import numpy as np
import pytest
import torch

from deepspeed_ppq.models import GPT, GPTConfig, gpt_layers, gpt_loss, layer_kinds


def test_gpt_layers_are_the_reference_model():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=3)
    layers = gpt_layers(cfg, seed=3)
    model = GPT(cfg, seed=3)
    assert len(layers) == cfg.n_layers + 2 == len(layer_kinds(cfg))
    x = torch.randint(0, 64, (2, 16))
    h = x
    for layer in layers:
        h = layer(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    loss = gpt_loss(model(x), x)
    assert abs(loss.item() - np.log(64)) < 0.5  # near-uniform predictions at init


def test_gpt_is_causal():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    model = GPT(cfg)
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 64
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])


def test_bad_gpt_config():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_heads=4"):
        GPTConfig(d_model=30, n_heads=4)
