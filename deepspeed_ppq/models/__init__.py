"""Small models shipped with deepspeed_ppq for tests, benchmarks and the demo."""

from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_layers, gpt_loss, layer_kinds

__all__ = ["GPT", "GPTConfig", "gpt_layers", "gpt_loss", "layer_kinds"]
