#!/usr/bin/env bash
# One hardware check of megatron_kd (see tools/gpu_check.py): the fused loss against the fp64
# reference, the loss benchmark, a bf16 training step (GPU only) and a top-K cache build.
#
#   bash tools/gpu_check.sh                      # CUDA when a GPU is usable, else the CPU
#   bash tools/gpu_check.sh --device cpu --out /tmp/gpu_check_cpu
#   bash tools/gpu_check.sh --steps parity bench_loss
#
# Writes <out>/report.json and <out>/report.md (default out: gpu_check_out/); exits non-zero
# when a step failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
exec "${PYTHON:-python}" tools/gpu_check.py "$@"
