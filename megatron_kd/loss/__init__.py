"""The fused vocab-parallel KD loss.

``vocab_parallel_kd_loss`` computes the exact full-vocabulary KD (+ CE) loss from hidden states
and output-layer shards, in row windows, combining per-row values across the tensor-parallel
group; the ``[tokens, vocab]`` logits never exist. ``KDLossConfig.cpu_tuning`` (a
``CpuTuning``) says how a window is worked through on CPU; by default this machine's. CUDA inputs
take the GPU path (:mod:`megatron_kd.loss.gpu`, tuned by ``KDLossConfig.gpu_tuning``, a
``GpuTuning``); ``KDLossConfig.path`` chooses either path by hand.
"""

from megatron_kd.loss.config import CpuTuning, GpuTuning, KDLossConfig
from megatron_kd.loss.fused import vocab_parallel_kd_loss

__all__ = ["CpuTuning", "GpuTuning", "KDLossConfig", "vocab_parallel_kd_loss"]
