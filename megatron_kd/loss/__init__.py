"""The fused vocab-parallel KD loss.

``vocab_parallel_kd_loss`` computes the exact full-vocabulary KD (+ CE) loss from hidden states
and output-layer shards, in row windows, combining per-row values across the tensor-parallel
group; the ``[tokens, vocab]`` logits never exist. ``KDLossConfig.cpu_tuning`` (a
``CpuTuning``) says how a window is worked through on CPU; by default this machine's. CUDA inputs
take the GPU path (:mod:`megatron_kd.loss.gpu`, tuned by ``KDLossConfig.gpu_tuning``, a
``GpuTuning``); ``KDLossConfig.path`` chooses either path by hand, or ``"dense"``: the
reference baseline ``dense_logits_kd_loss``, which writes the logits (for benchmarks). The
teacher's side is one record, a ``DenseTeacher`` (hidden states and output-layer shard) or a
``TopKTeacher`` (top-K ids and log-probs): ``Teacher``. For evaluation,
``vocab_parallel_agreement`` gives the student-teacher KL at T = 1 and top-1 agreement
(``AgreementSums``) over the same shards, the logits again never formed. Several teachers at
once: ``mixture_kd_loss`` (a weighted mixture, forward KL; the fused loss once per teacher).
"""

from megatron_kd.loss.agreement import AgreementSums, vocab_parallel_agreement
from megatron_kd.loss.config import CpuTuning, GpuTuning, KDLossConfig
from megatron_kd.loss.dense import dense_logits_kd_loss
from megatron_kd.loss.fused import vocab_parallel_kd_loss
from megatron_kd.loss.mixture import TeacherMixture, mixture_kd_loss, mixture_weights
from megatron_kd.loss.teacher import DenseTeacher, Teacher, TopKTeacher

__all__ = ["AgreementSums", "CpuTuning", "DenseTeacher", "GpuTuning", "KDLossConfig", "Teacher",
           "TeacherMixture", "TopKTeacher", "dense_logits_kd_loss", "mixture_kd_loss",
           "mixture_weights", "vocab_parallel_agreement", "vocab_parallel_kd_loss"]
