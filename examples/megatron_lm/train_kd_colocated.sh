#!/bin/bash
# Distil a student from a megatron_kd teacher checkpoint with Megatron-LM's own pretrain_gpt.py
# (patched: see patches/README.md), colocated: every GPU holds the student and, on the last
# pipeline stage, the frozen teacher.
#
#   cd Megatron-LM    # with its patch applied (patches/README.md: main or the pinned commit)
#   STUDENT=/ckpt/student bash /path/to/megatron_kd/examples/megatron_lm/train_kd_colocated.sh \
#       CHECKPOINT_DIR TENSORBOARD_DIR TEACHER_DIR DATA_PREFIX HF_TOKENIZER [more flags]
#
#   CHECKPOINT_DIR  where the student is saved to and resumed from
#   TEACHER_DIR     a megatron_kd checkpoint (`megatron-kd import-hf`, or `megatron-kd train --save`)
#   DATA_PREFIX     an indexed dataset made with the teacher's tokenizer (Megatron-LM's
#                   tools/preprocess_data.py or `megatron-kd preprocess`)
#   HF_TOKENIZER    the teacher's Hugging Face tokenizer (the model directory or name it was
#                   imported from): student and teacher must tokenize alike
#   more flags      appended to the command line (a value flag given again wins)
#
# The student:
#   STUDENT=DIR           an `import-hf` directory: its megatron_lm_flags.txt gives the model
#                         flags and --pretrained-checkpoint its weights (taken only when
#                         CHECKPOINT_DIR holds no checkpoint yet: a restart resumes its own)
#   MODEL_ARGS_FILE=FILE  else: model flags from FILE (one or more a line, # comments), random init
#   neither               a ~1B Llama-style student (the block below), random init
# The run (environment, defaults in brackets): SEQ_LENGTH [4096], MICRO_BATCH [1],
# GLOBAL_BATCH [256], TRAIN_ITERS [20000], LR [3.0e-4], MIN_LR [LR / 10], WARMUP [500],
# PRECISION [bf16; fp32 for none], KD_LOSS [forward_kl], KD_WEIGHT [1.0], KD_CE_WEIGHT [0.0],
# KD_TEMPERATURE [1.0].
# Multi-node: set NUM_NODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node (the Slurm
# script examples/slurm/megatron_lm.sbatch does). TP, PP, CP (context parallelism) and
# VP_LAYERS (layers per virtual pipeline stage) set the layout.
# KD_MODE=offline (train_kd_offline.sh sets it): the third argument is a top-K cache made by
# `megatron-kd cache build`, which stands in for the teacher.
# PRETRAIN_GPT [pretrain_gpt.py]: the script torchrun runs (with any launcher before it).
set -euo pipefail

CHECKPOINT_DIR=${1:?checkpoint directory}
TENSORBOARD_DIR=${2:?tensorboard directory}
TEACHER_DIR=${3:?teacher checkpoint directory (KD_MODE=offline: the top-K cache)}
DATA_PREFIX=${4:?data prefix}
HF_TOKENIZER=${5:?Hugging Face tokenizer of the teacher}
shift 5

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-1}
CP=${CP:-1}

export CUDA_DEVICE_MAX_CONNECTIONS=1

if [ "${KD_MODE:-colocated}" = offline ]; then
    # The cache's top-K ids lie in its teacher's true vocabulary, which the student's padded one
    # must hold (Megatron-LM's own padding does: same tokenizer).
    VOCAB_ARGS=()
    KD_SOURCE_ARGS=(--kd-mode offline --kd-topk-cache "$TEACHER_DIR"
                    --kd-topk-tail "${KD_TOPK_TAIL:-renormalize}")
else
    # Student and teacher need one vocabulary partition: pad the student's vocabulary to exactly
    # the teacher's padded size (Megatron-LM pads to a multiple of divisible-by x TP).
    TEACHER_PADDED_VOCAB=$(python -c 'import json, sys
print(json.load(open(sys.argv[1] + "/model_config.json"))["arch"]["padded_vocab_size"])' \
        "$TEACHER_DIR")
    VOCAB_ARGS=(--make-vocab-size-divisible-by $((TEACHER_PADDED_VOCAB / TP)))
    KD_SOURCE_ARGS=(--kd-mode colocated --kd-teacher-load "$TEACHER_DIR" --kd-teacher-dtype "${KD_TEACHER_DTYPE:-bf16}")
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

SEQ_LENGTH=${SEQ_LENGTH:-4096}
STUDENT_ARGS=()
if [ -n "${STUDENT:-}" ]; then
    MODEL_ARGS_FILE=${MODEL_ARGS_FILE:-$STUDENT/megatron_lm_flags.txt}
    [ -f "$MODEL_ARGS_FILE" ] || { echo "STUDENT=$STUDENT has no $MODEL_ARGS_FILE: a model" \
        "Megatron-LM's GPT flags cannot express (megatron-kd import-hf said why); train it" \
        "with megatron-kd train" >&2; exit 2; }
    STUDENT_ARGS=(--pretrained-checkpoint "$STUDENT")
fi
if [ -n "${MODEL_ARGS_FILE:-}" ]; then
    # shellcheck disable=SC2207 - flags and values hold no spaces
    GPT_MODEL_ARGS=($(sed 's/#.*//' "$MODEL_ARGS_FILE"))
else
    GPT_MODEL_ARGS=(
        --num-layers 16
        --hidden-size 2048
        --ffn-hidden-size 8192
        --num-attention-heads 16
        --group-query-attention
        --num-query-groups 8
        --max-position-embeddings "$SEQ_LENGTH"
        --position-embedding-type rope
        --normalization RMSNorm
        --swiglu
        --disable-bias-linear
        --untie-embeddings-and-output-weights
    )
fi
GPT_MODEL_ARGS+=(--seq-length "$SEQ_LENGTH" --attention-backend auto "${STUDENT_ARGS[@]}")

LR=${LR:-3.0e-4}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-1}"
    --global-batch-size "${GLOBAL_BATCH:-256}"
    --train-iters "$TRAIN_ITERS"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --lr "$LR"
    --lr-decay-style cosine
    --min-lr "${MIN_LR:-$(awk "BEGIN { print $LR / 10 }")}"
    --lr-warmup-iters "${WARMUP:-500}"
    --lr-decay-iters "$TRAIN_ITERS"
)
case "${PRECISION:-bf16}" in
    bf16) TRAINING_ARGS+=(--bf16) ;;
    fp32) ;;
    *) echo "PRECISION must be bf16 or fp32, got $PRECISION" >&2; exit 2 ;;
esac

# Sequence parallelism: the student's and the teacher's norms and activations split along the
# sequence over the TP ranks (Megatron-LM turns it off at TP 1). VP_LAYERS (optional): layers per
# virtual pipeline stage, the interleaved schedule (PP > 1; the microbatches of a step must be a
# multiple of PP). CP: each sequence in 2 x CP load-balanced chunks, two a rank (Transformer
# Engine's attention; the teacher runs on the same chunks); --seq-length must divide by 2 x CP x TP.
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
    --sequence-parallel
    "${VOCAB_ARGS[@]}"
)
if [ -n "${VP_LAYERS:-}" ]; then
    MODEL_PARALLEL_ARGS+=(--num-layers-per-virtual-pipeline-stage "$VP_LAYERS")
fi

DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$HF_TOKENIZER"
    --split 969,30,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --tensorboard-dir "$TENSORBOARD_DIR"
)

# The KD flags: the same as `megatron-kd train` accepts.
KD_ARGS=(
    "${KD_SOURCE_ARGS[@]}"
    --kd-loss "${KD_LOSS:-forward_kl}"
    --kd-temperature "${KD_TEMPERATURE:-1.0}"
    --kd-weight "${KD_WEIGHT:-1.0}"
    --kd-ce-weight "${KD_CE_WEIGHT:-0.0}"
)

# shellcheck disable=SC2206 - a launcher and its script
PRETRAIN_GPT=(${PRETRAIN_GPT:-pretrain_gpt.py})
torchrun "${DISTRIBUTED_ARGS[@]}" "${PRETRAIN_GPT[@]}" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${KD_ARGS[@]}" \
    "$@"
