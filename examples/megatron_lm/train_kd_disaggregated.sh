#!/bin/bash
# The disaggregated counterpart of train_kd_colocated.sh: Megatron-LM's own pretrain_gpt.py
# (patched: see patches/README.md) trains the student on every GPU of this job; the teacher runs
# elsewhere, as one or more `megatron-kd teacher serve` replicas registered at an endpoint, and
# sends its final hidden states back for the token ids the student sends it. The student's GPUs
# hold only the teacher's output-layer shard.
#
#   # the teacher, once (its own job, its own TP/PP; more replicas: submit it again):
#   KD_TEACHER_LOAD=/data/teacher_kd KD_TEACHER_ENDPOINT=/shared/endpoints/teacher \
#       sbatch --nodes=1 /path/to/megatron_kd/examples/slurm/teacher.sbatch
#   # the student, in a Megatron-LM checkout with its patch applied (patches/README.md):
#   cd Megatron-LM
#   KD_TEACHER_ENDPOINT=/shared/endpoints/teacher \
#   bash /path/to/megatron_kd/examples/megatron_lm/train_kd_disaggregated.sh \
#       CHECKPOINT_DIR TENSORBOARD_DIR TEACHER_DIR DATA_PREFIX HF_TOKENIZER [more flags]
#
# The arguments are train_kd_colocated.sh's (TEACHER_DIR is the same checkpoint the replicas
# serve: the student checks the replica's identity against it at connect and loads its output
# layer). KD_TEACHER_ENDPOINT: the directory the replicas register in (shared storage), or
# host:port of a `megatron-kd teacher registry`. KD_PREFETCH_DEPTH (default 2): microbatches
# the token ids go out ahead of training. KD_WIRE_DTYPE (default: the teacher's dtype): fp8
# halves the bytes of bf16.
set -euo pipefail

: "${KD_TEACHER_ENDPOINT:?set KD_TEACHER_ENDPOINT to the teacher replicas' endpoint}"
KD_ARGS=(
    --kd-mode disaggregated
    --kd-teacher-endpoint "$KD_TEACHER_ENDPOINT"
    --kd-prefetch-depth "${KD_PREFETCH_DEPTH:-2}"
    --kd-teacher-timeout "${KD_TEACHER_TIMEOUT:-600}"
)
if [ -n "${KD_WIRE_DTYPE:-}" ]; then KD_ARGS+=(--kd-wire-dtype "$KD_WIRE_DTYPE"); fi

# Everything else as in the colocated script; flags given later win, so these switch the mode.
if [ $# -lt 5 ]; then
    echo "usage: KD_TEACHER_ENDPOINT=E $0 CHECKPOINT_DIR TENSORBOARD_DIR TEACHER_DIR DATA_PREFIX HF_TOKENIZER [more flags]" >&2
    exit 2
fi
exec bash "$(dirname "$0")/train_kd_colocated.sh" "${@:1:5}" "${KD_ARGS[@]}" "${@:6}"
