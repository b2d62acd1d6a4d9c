"""Front ends that put the ppq pieces into training frameworks.

``deepspeed_ppq.integrations.deepspeed``: ``initialize`` (drop-in for ``deepspeed.initialize``) and
``PPQPipelineEngine``; ``deepspeed_ppq.integrations.pipe_module``: ``PPQPipelineModule`` with explicit
stage boundaries; ``WithSampleIds`` gives AQ-SGD the dataset index of every sample.
"""

from __future__ import annotations

import torch

__all__ = ["WithSampleIds"]


class WithSampleIds(torch.utils.data.Dataset):
    """Wrap a dataset of ``(inputs, labels)`` so items become ``(inputs, labels, index)``.

    AQ-SGD keys its per-sample buffers by this index; the first pipeline stage reads it from the
    batch and sends it along with the activation to every later stage.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        inputs, labels = self.dataset[i]
        return inputs, labels, torch.tensor(i, dtype=torch.int64)
