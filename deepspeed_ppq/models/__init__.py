"""A small GPT shipped with the package: a flat list of layers that DeepSpeed's ``PipelineModule`` can cut
anywhere, with the Linear names precision rules match. Users try the package on it (docs/deepspeed.md);
its sequential form (``GPT``) is the single-process reference the distributed tests compare with."""

from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_layers, gpt_loss, layer_kinds

__all__ = ["GPT", "GPTConfig", "gpt_layers", "gpt_loss", "layer_kinds"]
