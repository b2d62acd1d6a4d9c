import numpy as np
import pytest
import torch
from stdlib_text import BPETokenizer, TokenDataset, build_token_datasets, load_corpus

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


def test_bpe_round_trip_and_merges():
    text = "def foo(x):\n    return x + 1\n" * 50
    tok, ids = BPETokenizer.train(text, 300)
    assert tok.vocab_size > 256 and len(ids) < len(text.encode()) / 3
    assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode(text), ids)


def test_corpus_split_and_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("PPQ_CACHE_DIR", str(tmp_path))
    train_text, val_text = load_corpus(200_000)
    assert len(train_text) > 5 * len(val_text) > 0
    train, val, tok = build_token_datasets(seq_len=32, vocab_size=300, max_bytes=200_000)
    x, y = train[5]
    assert x.shape == y.shape == (32,)
    torch.testing.assert_close(x[1:], y[:-1])
    # a second build loads the cache and gives identical tokens
    train2, _, _ = build_token_datasets(seq_len=32, vocab_size=300, max_bytes=200_000)
    torch.testing.assert_close(train2[5][0], x)
    with pytest.raises(ValueError, match="too few"):
        TokenDataset(np.arange(10), 32)
