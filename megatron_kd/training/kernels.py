"""Which kernels a command's models are built with: one flag section for every command that
builds a model from its flags (``megatron-kd train``: the student and a colocated teacher;
``teacher serve`` and ``cache build``: the teacher)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_kd.flags import flag
from megatron_kd.integration.sdpa_attention import ATTENTION_CHOICES

__all__ = ["TRANSFORMER_IMPLS", "KernelSection"]

_PARALLEL = "parallelism and precision"

#: ``--transformer-impl``'s choices (Megatron-LM's names).
TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True, kw_only=True)
class KernelSection:
    """Which kernels the models' layers run: one section for every command that builds a model
    from its flags (``megatron-kd train``: the student and a colocated teacher; ``teacher
    serve`` and ``cache build``: the teacher), handed to the model builder
    (:func:`~megatron_kd.integration.gpt.build_gpt_model`); nothing reads the environment for
    it."""

    attention_backend: str = flag(
        "auto", "the core attention of softmax attention layers built without Transformer "
                "Engine (Megatron-LM's flag, this project's choices): 'auto' (on a GPU torch's "
                "scaled_dot_product_attention, no [s, s] scores; on the CPU Megatron-Core's "
                "DotProductAttention), 'sdpa' or 'unfused' (DotProductAttention, the scores "
                "formed) everywhere", choices=ATTENTION_CHOICES, group=_PARALLEL)
    """``auto``, ``sdpa`` or ``unfused``
    (:data:`~megatron_kd.integration.sdpa_attention.ATTENTION_CHOICES`; docs/models.md,
    "Attention backends")."""

    transformer_impl: str | None = flag(
        None, "the layers' implementation (Megatron-LM's flag): transformer_engine (what is "
              "built wherever Transformer Engine is installed and a GPU is there) or local "
              "(Megatron-Core's own layers: what is built where it is not); default: whichever "
              "is usable. Asking for the one that is not usable here is an error, not a "
              "fallback", choices=TRANSFORMER_IMPLS, group=_PARALLEL)
    """None (the usable one), or one of :data:`TRANSFORMER_IMPLS`, checked against the
    machine by :meth:`check_transformer_impl`."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_CHOICES:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: choose from "
                             f"{', '.join(ATTENTION_CHOICES)}")
        if self.transformer_impl not in (None, *TRANSFORMER_IMPLS):
            raise ValueError(f"--transformer-impl {self.transformer_impl!r}: choose from "
                             f"{', '.join(TRANSFORMER_IMPLS)}")

    def check_transformer_impl(self, transformer_engine: bool) -> None:
        """``ValueError`` when ``--transformer-impl`` asks for layers this machine does not
        build: the models are Transformer Engine's exactly when ``transformer_engine`` (a GPU
        and the package; :func:`~megatron_kd.integration.gpt.transformer_engine_available`)."""
        built = "transformer_engine" if transformer_engine else "local"
        if self.transformer_impl not in (None, built):
            why = ("Transformer Engine is usable here (a GPU and the package), and the "
                   "models are built with it; uninstall transformer-engine to build the local "
                   "layers" if transformer_engine else
                   "Transformer Engine is not usable here (it needs a GPU and the "
                   "transformer-engine package: docs/install.md), so the models are built with "
                   "Megatron-Core's local layers; give --transformer-impl local or drop the flag")
            raise ValueError(f"--transformer-impl {self.transformer_impl}: {why}")
