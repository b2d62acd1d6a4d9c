#!/usr/bin/env bash
# Megatron-LM (tag core_v0.16.1) pretrain_gpt.py with deepspeed_ppq, on one 8-GPU node:
# PP=4 x DP=2, int8 weights in the middle blocks (ppq QuantLinear, local layer spec, TP=1),
# 8-bit per-token activations and gradients between stages with error feedback on activations.
# Run from a Megatron-LM checkout with deepspeed_ppq installed:  bash pretrain_gpt_ppq.sh
# Multi-node: see pretrain_gpt_ppq.sbatch. tests/megatron/test_megatron_args.py validates the flags below.
set -euo pipefail
# The data has no default that holds on every machine: stop here, before anything starts, when one is unset.
DATA_PATH=${DATA_PATH:?set DATA_PATH to the dataset prefix (my-gpt2_text_document, without .bin/.idx)}
VOCAB=${VOCAB:?set VOCAB to the GPT-2 vocabulary file (gpt2-vocab.json)}
MERGES=${MERGES:?set MERGES to the GPT-2 merges file (gpt2-merges.txt)}
CKPT=${CKPT:-$PWD/checkpoints/gpt-ppq}  # under the directory it runs from (sbatch: the submit directory)

ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --transformer-impl local
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
  --micro-batch-size 2 --global-batch-size 256 --train-iters 50000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1000 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --untie-embeddings-and-output-weights
  --data-path "$DATA_PATH" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 949,50,1
  --save "$CKPT" --load "$CKPT" --save-interval 1000 --eval-interval 1000 --eval-iters 10 --log-interval 10
  --ppq-weights-format int8 --ppq-weights-block-size 64
  --ppq-weights-keep-first-blocks 1 --ppq-weights-keep-last-blocks 1
  --ppq-activations-method quant --ppq-activations-bits 8 --ppq-activations-granularity token
  --ppq-activations-error-feedback ef
  --ppq-gradients-method quant --ppq-gradients-bits 8
  --ppq-warmup-steps 100
)

# Sourced (by pretrain_gpt_ppq.sbatch): define the variables and ARGS only.
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then return 0; fi
torchrun --nproc-per-node 8 -m megatron_patches.run pretrain_gpt.py "${ARGS[@]}"
