#!/bin/bash
# The disaggregated counterpart of train_kd_colocated.sh: the teacher on GPUs of its own,
# streaming its final hidden states to the student's last pipeline stage.
#
# Megatron-LM's pretrain_gpt.py cannot host this mode (Megatron-LM lays its process groups over
# the whole world, leaving no ranks for a teacher; the patched script refuses
# --kd-mode disaggregated), so this launches `megatron-kd train`, which takes the same
# Megatron-LM-spelled model / optimiser / data flags (a subset: see `megatron-kd train --help`)
# and the same --kd-* flags, on Megatron-Core.
#
#   bash examples/megatron_lm/train_kd_disaggregated.sh \
#       CHECKPOINT_DIR TEACHER_DIR DATA_PREFIX TOKENIZER_JSON [more flags]
#
#   TEACHER_DIR     a megatron_kd checkpoint (`megatron-kd import-hf`, or `megatron-kd train --save`)
#   DATA_PREFIX     an indexed dataset made with the teacher's tokenizer (`megatron-kd preprocess`
#                   or Megatron-LM's tools/preprocess_data.py)
#   TOKENIZER_JSON  the teacher's tokenizer.json
#
# The world is NUM_NODES x GPUS_PER_NODE ranks: the first ones train the student, the last
# TEACHER_GPUS serve the teacher (size them with `megatron-kd plan`).
# Multi-node: set NUM_NODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node.
set -euo pipefail

CHECKPOINT_DIR=${1:?checkpoint directory}
TEACHER_DIR=${2:?teacher checkpoint directory}
DATA_PREFIX=${3:?data prefix}
TOKENIZER_JSON=${4:?teacher tokenizer.json}
shift 4

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TEACHER_GPUS=${TEACHER_GPUS:-4}
TEACHER_TP=${TEACHER_TP:-4}
TP=${TP:-2}
PP=${PP:-1}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

# As in train_kd_colocated.sh; SwiGLU and bias-free linears are `megatron-kd train`'s defaults,
# and the vocabulary (with its padding) comes from the teacher.
GPT_MODEL_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 16
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --train-iters 20000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --lr-warmup-iters 500
    --lr-decay-iters 20000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)

DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --tokenizer-model "$TOKENIZER_JSON"
    --split 969,30,1
)

EVAL_AND_LOGGING_ARGS=(
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --log-json "$CHECKPOINT_DIR/log.jsonl"
)

KD_ARGS=(
    --kd-mode disaggregated
    --kd-teacher-world-size "$TEACHER_GPUS"
    --kd-teacher-tensor-model-parallel-size "$TEACHER_TP"
    --kd-teacher-pipeline-model-parallel-size 1
    --kd-prefetch-depth 2
    --kd-teacher-load "$TEACHER_DIR"
    --kd-teacher-dtype bf16
    --kd-loss forward_kl
    --kd-temperature 1.0
    --kd-weight 1.0
    --kd-ce-weight 0.0
)

torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_kd train \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${KD_ARGS[@]}" \
    "$@"
