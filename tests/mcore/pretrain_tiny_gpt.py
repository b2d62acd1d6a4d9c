"""A tiny stand-in for Megatron-LM's pretrain_gpt.py, for tests of ``python -m megatron_patches.run``.

It does what ``megatron.training.pretrain`` does with its arguments (Megatron-LM's ``megatron/training``
is not pip-installable): an argparse parser, an optional ``extra_args_provider``, a megatron-core
``GPTModel`` (local layer spec) per pipeline stage, and megatron-core's own pipeline schedule from
``get_forward_backward_func()`` without a communicator, the way Megatron-LM's ``train_step`` calls it.
It knows nothing about ppq unless ``--use-extra-args-provider`` is given (then it registers
``add_ppq_args`` and calls ``megatron_patches.apply``, as an adapted script would).

Like Megatron-LM it assumes CUDA (``model_parallel_cuda_manual_seed``, ``.cuda()``, the schedule's CUDA
allocations), so on CPU it runs only under the launcher's CPU mode (``megatron_patches.run``, automatic
without a GPU). Reports per-step losses (last stage), the layers on each stage, the number of low-bit
layers and the communicator's byte counters through ``write_result``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from dist_utils import write_result


def parse_args(extra_args_provider=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tiny pretrain_gpt", allow_abbrev=False)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    p.add_argument("--pipeline-model-parallel-layout", default=None)
    p.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine"])
    p.add_argument("--use-extra-args-provider", action="store_true")
    p.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    # Megatron-LM's flags for kernels that CPU mode turns off; accepted, nothing here uses them.
    p.add_argument("--no-persist-layer-norm", action="store_true")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_true")
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    return p.parse_args()


def batches(args, step: int):
    """Sequences that count up from a random start: learnable in a few steps."""
    g = torch.Generator().manual_seed(step)
    n = args.global_batch_size // args.micro_batch_size
    for _ in range(n):
        start = torch.randint(0, args.vocab_size, (args.micro_batch_size, 1), generator=g)
        seq = (start + torch.arange(args.seq_length + 1)) % args.vocab_size
        yield seq[:, :-1], seq[:, 1:]


def main() -> None:
    import sys

    use_provider = "--use-extra-args-provider" in sys.argv
    provider = None
    if use_provider:
        from megatron_patches import add_ppq_args

        provider = add_ppq_args
    args = parse_args(provider)

    dist.init_process_group(args.distributed_backend)
    torch.set_num_threads(1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.layers import QuantParallelLinear

    if use_provider:
        from megatron_patches import apply

        apply(args)
    if args.transformer_impl != "local":
        raise SystemExit("this CPU test script builds the local spec only: add --transformer-impl local")
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size,
                                             args.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    position_ids = torch.arange(args.seq_length).expand(args.micro_batch_size, -1).cuda()

    def forward_step(data_iterator, model):
        tokens, labels = (t.cuda(non_blocking=True) for t in next(data_iterator))
        out = model(tokens, position_ids, attention_mask=None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place
        return out, loss_func

    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(args.train_iters):
        optimizer.zero_grad(set_to_none=True)
        res = forward_backward(forward_step_func=forward_step, data_iterator=batches(args, step),
                               model=model, num_microbatches=args.global_batch_size // args.micro_batch_size,
                               seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        optimizer.step()
        if res:
            losses.append(sum(float(r["lm loss"]) for r in res) / len(res))

    from megatron.core.pipeline_parallel import schedules

    comm_cls = schedules.P2PCommunicator
    codecs = list((getattr(comm_cls, "shared_codecs", None) or {}).values())
    write_result({
        "rank": dist.get_rank(), "losses": losses, "stage_layers": len(model.decoder.layers),
        "lowbit_layers": sum(isinstance(m, QuantParallelLinear) for m in model.modules()),
        "lowbit_formats": sorted({m.format.value for m in model.modules()
                                  if isinstance(m, QuantParallelLinear)}),
        "communicator": comm_cls.__name__,
        "raw_bytes": codecs[0].raw_bytes if codecs else None,
        "wire_bytes": codecs[0].wire_bytes if codecs else None,
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
