#!/usr/bin/env bash
# Colocated distillation on 2 CPU processes (gloo), tensor parallel 2.
#
#   TEACHER  a megatron_kd checkpoint (`megatron-kd import-hf`, or any checkpoint written by
#            megatron_kd.integration.checkpoint.save_model_checkpoint / `megatron-kd train --save`)
#   TOKENIZER  the teacher's tokenizer.json
#   TEXT     a directory of .txt files
set -euo pipefail
TEACHER=${TEACHER:?set TEACHER to a teacher checkpoint directory}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the teacher tokenizer.json}
TEXT=${TEXT:?set TEXT to a directory of .txt files}
OUT=${OUT:-runs/colocated_cpu}

megatron-kd preprocess --input "$TEXT" --tokenizer-model "$TOKENIZER" \
    --output-prefix "$OUT/data/text"

torchrun --standalone --nproc-per-node 2 -m megatron_kd train \
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 8 \
    --tensor-model-parallel-size 2 \
    --train-iters 300 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
    --data-path "$OUT/data/text" --split 95,5,0 --tokenizer-model "$TOKENIZER" \
    --eval-interval 50 --eval-iters 4 \
    --kd-teacher-load "$TEACHER" --kd-loss forward_kl --kd-temperature 1.0 \
    --kd-weight 0.5 --kd-ce-weight 0.5 --kd-teacher-dtype bf16 \
    --save "$OUT/ckpt" --save-interval 100 --load "$OUT/ckpt" \
    --log-json "$OUT/log.jsonl"
