#!/bin/bash
# The offline counterpart of train_kd_colocated.sh: Megatron-LM's own pretrain_gpt.py (patched:
# see patches/README.md) trains the student against a top-K teacher cache; no teacher runs
# during training, and no GPU holds any of it.
#
#   # the cache, once, with the run's data flags (its samples are the ones the student reads):
#   torchrun --nproc-per-node 8 -m megatron_kd cache build --out /data/topk_cache \
#       --kd-teacher-load /data/teacher_kd --kd-topk 64 --tensor-model-parallel-size 8 \
#       --data-path /data/text_document --tokenizer-model /models/teacher-hf \
#       --seq-length 4096 --split 969,30,1 --seed 1234 --micro-batch-size 1 \
#       --train-iters 20000 --global-batch-size 256 --eval-iters 10
#   # the student, in a Megatron-LM checkout with its patch applied:
#   cd Megatron-LM
#   bash /path/to/megatron_kd/examples/megatron_lm/train_kd_offline.sh \
#       CHECKPOINT_DIR TENSORBOARD_DIR TOPK_CACHE DATA_PREFIX HF_TOKENIZER [more flags]
#
# The arguments are train_kd_colocated.sh's with the cache in the teacher's place. The cache is
# keyed by its samples' tokens: each microbatch's rows are found by the fingerprints of its token
# ids, whatever the layout (DP, TP, PP, CP, micro-batch size); a sample the cache does not hold
# (other data flags: --data-path, --split, --seq-length, --seed, --train-iters,
# --global-batch-size) stops the run before its optimizer step, naming the sample and the cache.
# KD_TOPK_TAIL (default renormalize): how the tail outside the cached K is treated.
set -euo pipefail

if [ $# -lt 5 ]; then
    echo "usage: $0 CHECKPOINT_DIR TENSORBOARD_DIR TOPK_CACHE DATA_PREFIX HF_TOKENIZER [more flags]" >&2
    exit 2
fi
KD_MODE=offline exec bash "$(dirname "$0")/train_kd_colocated.sh" "$@"
