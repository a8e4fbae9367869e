"""The disaggregated teacher: teacher ranks stream final hidden states to student ranks.

* :mod:`~megatron_kd.teacher.wire` -- self-describing messages (header + payload) and their
  errors.
* :mod:`~megatron_kd.teacher.ring` -- the student's prefetch ring of receive slots.
* :mod:`~megatron_kd.teacher.remote` -- the student side: hidden states per microbatch.
* :mod:`~megatron_kd.teacher.server` -- the teacher side: forward, chunk, send.

Pure torch and ``torch.distributed``: the Megatron-Core model and schedule are handed in by
:mod:`megatron_kd.training.disaggregated`.
"""

from megatron_kd.teacher.remote import RemoteTeacher
from megatron_kd.teacher.ring import PrefetchRing
from megatron_kd.teacher.server import TeacherServer
from megatron_kd.teacher.wire import (
    Header,
    HeaderMismatchError,
    HiddenSender,
    TeacherUnavailableError,
)

__all__ = ["Header", "HeaderMismatchError", "HiddenSender", "PrefetchRing", "RemoteTeacher",
           "TeacherServer", "TeacherUnavailableError"]
