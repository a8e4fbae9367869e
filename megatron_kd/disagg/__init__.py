"""Disaggregated teacher: teacher ranks stream final hidden states to student ranks."""

from megatron_kd.disagg.wire import (Header, HeaderMismatchError, HiddenSender, PrefetchRing,
                                     TeacherUnavailableError)

__all__ = ["Header", "HeaderMismatchError", "HiddenSender", "PrefetchRing",
           "TeacherUnavailableError"]
