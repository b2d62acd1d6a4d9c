"""The examples' text data (examples/stdlib_text.py): the BPE tokenizer round-trips, the stdlib corpus
splits by file, and the token datasets are cached."""

import numpy as np
import pytest
import torch
from stdlib_text import BPETokenizer, TokenDataset, build_token_datasets, load_corpus


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
