"""The examples' text, on every machine: the Python standard library's own source files.

Nothing is downloaded. The corpus is the ``.py`` files under ``sysconfig``'s stdlib path (tests and
site-packages left out), in sorted order; every 10th file goes to validation, so the split is by
document and deterministic. A byte-level BPE tokenizer is trained on the training text with numpy
(a few seconds) and cached under ``~/.cache/deepspeed_ppq`` (``PPQ_CACHE_DIR`` overrides).

Fine-tuning text (``build_finetune_datasets``) is another domain of the same source: the stdlib files
past the pretraining text, encoded with the pretraining tokenizer.

The example scripts import this module as ``stdlib_text``: their folder is on ``sys.path`` when they run
(directly, under the ``deepspeed`` launcher or under ``ppq tune``). The demo, the tests and the quality
benchmark put ``examples/`` on ``sys.path`` themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_corpus", "BPETokenizer", "TokenDataset", "build_token_datasets", "finetune_texts",
           "build_finetune_datasets", "cache_dir"]

_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__", "lib2to3"}


def cache_dir() -> Path:
    d = Path(os.environ.get("PPQ_CACHE_DIR", Path.home() / ".cache" / "deepspeed_ppq"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]):
            continue
        files.append(p)
    if not files:
        raise RuntimeError(f"no Python standard library sources found under {root}")
    return files


def load_corpus(max_bytes: int = 4_000_000, val_every: int = 10) -> tuple[str, str]:
    """(train_text, val_text) from the stdlib sources, at most ``max_bytes`` in all.

    Every ``val_every``-th file (in sorted order) is validation text.
    """
    if max_bytes < 10_000:
        raise ValueError(f"max_bytes={max_bytes} is too small: use at least 10000")
    train, val, total = [], [], 0
    for i, p in enumerate(_stdlib_files()):
        text = p.read_text(encoding="utf-8", errors="replace")
        (val if i % val_every == val_every - 1 else train).append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "\n".join(train), "\n".join(val)


def _merge(ids: np.ndarray, a: int, b: int, new: int) -> np.ndarray:
    """Replace every non-overlapping (a, b) pair, left to right, by ``new``."""
    hit = np.flatnonzero((ids[:-1] == a) & (ids[1:] == b))
    if hit.size == 0:
        return ids
    if a == b and hit.size > 1:  # runs like "aaa": keep a hit only if the previous kept one is not adjacent
        keep = np.ones(hit.size, dtype=bool)
        last = -2
        for j, h in enumerate(hit.tolist()):
            if h == last + 1:
                keep[j] = False
            else:
                last = h
        hit = hit[keep]
    out = ids.copy()
    out[hit] = new
    drop = np.zeros(ids.size, dtype=bool)
    drop[hit + 1] = True
    return out[~drop]


class BPETokenizer:
    """Byte-level BPE: 256 byte tokens plus ``vocab_size - 256`` learned merges."""

    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = [tuple(m) for m in merges]
        self.vocab_size = 256 + len(self.merges)
        self._bytes = [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            self._bytes.append(self._bytes[a] + self._bytes[b])

    @classmethod
    def train(cls, text: str, vocab_size: int) -> tuple[BPETokenizer, np.ndarray]:
        """Learn ``vocab_size - 256`` merges on ``text``; returns the tokenizer and ``text`` encoded."""
        if not 256 <= vocab_size <= 65536:
            raise ValueError(f"vocab_size={vocab_size} must be in [256, 65536]")
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        merges = []
        for new in range(256, vocab_size):
            pair = ids[:-1] * vocab_size + ids[1:]
            counts = np.bincount(pair, minlength=0)
            best = int(counts.argmax())
            if counts[best] < 2:
                break
            a, b = divmod(best, vocab_size)
            merges.append((a, b))
            ids = _merge(ids, a, b, new)
        return cls(merges), ids

    def encode(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        for new, (a, b) in enumerate(self.merges, start=256):
            ids = _merge(ids, a, b, new)
        return ids

    def decode(self, ids) -> str:
        return b"".join(self._bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"merges": self.merges}))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        return cls(json.loads(Path(path).read_text())["merges"])


class TokenDataset(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: ``(input_ids[T], labels[T])``.

    ``sample_index(i) == i``: the sample's index in the dataset, which AQ-SGD keys its buffers on.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        n = (len(tokens) - 1) // seq_len
        if n < 1:
            raise ValueError(f"{len(tokens)} tokens are too few for seq_len={seq_len}")
        self.seq_len = seq_len
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens[: n * seq_len + 1]).astype(np.int64))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} out of range [0, {self.n})")
        s = i * self.seq_len
        chunk = self.tokens[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def _write_atomic(d: Path, writers: dict) -> None:
    """Write each ``name -> writer(path)`` into ``d`` through a private folder, then move the files in:
    concurrent ranks may build the same cache."""
    tmp = d / f"tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    for name, write in writers.items():
        write(tmp / name)
    for f in tmp.iterdir():
        os.replace(f, d / f.name)
    tmp.rmdir()


def build_token_datasets(seq_len: int = 128, vocab_size: int = 512, max_bytes: int = 4_000_000
                         ) -> tuple[TokenDataset, TokenDataset, BPETokenizer]:
    """Train/validation datasets over the stdlib corpus with a locally trained BPE (cached)."""
    train_text, val_text = load_corpus(max_bytes)
    key = hashlib.sha256(f"{vocab_size}|{max_bytes}|{len(train_text)}|{len(val_text)}|"
                         f"{hashlib.sha256(train_text.encode()).hexdigest()}".encode()).hexdigest()[:16]
    d = cache_dir() / f"bpe-{key}"
    if (d / "train.npy").exists() and (d / "val.npy").exists() and (d / "tokenizer.json").exists():
        tok = BPETokenizer.load(d / "tokenizer.json")
        train_ids, val_ids = np.load(d / "train.npy"), np.load(d / "val.npy")
    else:
        tok, train_ids = BPETokenizer.train(train_text, vocab_size)
        val_ids = tok.encode(val_text)
        _write_atomic(d, {"train.npy": lambda f: np.save(f, train_ids.astype(np.int32)),
                          "val.npy": lambda f: np.save(f, val_ids.astype(np.int32)),
                          "tokenizer.json": tok.save})
    return TokenDataset(train_ids, seq_len), TokenDataset(val_ids, seq_len), tok


def finetune_texts(pretrain_bytes: int, skip_bytes: int = 250_000,
                   ft_bytes: int = 600_000) -> tuple[str, str]:
    """(train, validation) text of a fine-tuning domain: stdlib files past the pretraining text.

    The pretraining text is the first ``pretrain_bytes`` of the sorted stdlib files; the next
    ``skip_bytes`` are skipped (the rest of the package the pretraining text ends in) and the following
    ``ft_bytes`` are the fine-tuning files, split by file as the pretraining text is.
    """
    start = pretrain_bytes + skip_bytes
    tr0, va0 = load_corpus(start)
    tr1, va1 = load_corpus(start + ft_bytes)
    if not (tr1.startswith(tr0) and va1.startswith(va0)) or len(va1) <= len(va0) + 1:
        raise ValueError(f"ft_bytes={ft_bytes}: the stdlib has no held-out files past byte {start}; lower "
                         "pretrain_bytes/skip_bytes or raise ft_bytes")
    return tr1[len(tr0) + 1:], va1[len(va0) + 1:]


def build_finetune_datasets(seq_len: int, vocab_size: int, pretrain_bytes: int, skip_bytes: int = 250_000,
                            ft_bytes: int = 600_000) -> tuple[TokenDataset, TokenDataset, BPETokenizer]:
    """Train/validation datasets of the fine-tuning text (``finetune_texts``), encoded with the tokenizer
    of ``build_token_datasets(seq_len, vocab_size, pretrain_bytes)``; cached beside it."""
    _, _, tok = build_token_datasets(seq_len, vocab_size, pretrain_bytes)
    key = hashlib.sha256(f"ft|{vocab_size}|{pretrain_bytes}|{skip_bytes}|{ft_bytes}|"
                         f"{hashlib.sha256(json.dumps(tok.merges).encode()).hexdigest()}".encode()).hexdigest()[:16]
    d = cache_dir() / f"ft-{key}"
    if (d / "train.npy").exists() and (d / "val.npy").exists():
        train_ids, val_ids = np.load(d / "train.npy"), np.load(d / "val.npy")
    else:
        train_text, val_text = finetune_texts(pretrain_bytes, skip_bytes, ft_bytes)
        train_ids, val_ids = tok.encode(train_text), tok.encode(val_text)
        _write_atomic(d, {"train.npy": lambda f: np.save(f, train_ids.astype(np.int32)),
                          "val.npy": lambda f: np.save(f, val_ids.astype(np.int32))})
    return TokenDataset(train_ids, seq_len), TokenDataset(val_ids, seq_len), tok
