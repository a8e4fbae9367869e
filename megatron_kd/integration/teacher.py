"""The frozen teacher: one builder for every place a teacher model or its output layer is made.

:func:`check_teacher` checks a teacher checkpoint from its small files before anything is
built (``megatron-kd train``, ``cache build`` and Megatron-LM's entry points call it).

:func:`build_frozen_teacher` builds a teacher ``GPTModel`` from a checkpoint's architecture,
loads its weights and freezes it (eval mode, ``requires_grad=False``, output layer bypassed so it
returns final hidden states): colocated training, Megatron-LM's ``pretrain_gpt.py``, the
disaggregated teacher and the top-K cache build all call it. :func:`unpipelined_groups` gives
the process groups of a teacher that holds every layer on a rank of a pipelined student;
:func:`load_output_layer_shard` reads only the teacher's output layer (a student that receives
the teacher's hidden states projects them itself); :func:`full_sequence_forward` runs a built
teacher over whole sequences in its layout (``teacher serve`` and ``cache build``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.checkpoint import (
    MODEL_CONFIG_FILE,
    check_checkpoint_tensors,
    load_model_checkpoint,
    read_checkpoint_arch,
    resolve_model_dir,
)
from megatron_kd.integration.context_parallel import cp_positions, gather_positions
from megatron_kd.integration.cpu_shim import device_context
from megatron_kd.integration.gpt import build_gpt_model
from megatron_kd.integration.megatron_lm_checkpoint import (
    megatron_lm_teacher_arch,
    megatron_lm_teacher_dir,
)
from megatron_kd.integration.output_layer import bypass_output_layer, to_sbh
from megatron_kd.loss.combine import gather_sequence
from megatron_kd.parallel.sequence import sequence_parts
from megatron_kd.placement import compute_device

__all__ = ["build_frozen_teacher", "check_teacher", "full_sequence_forward",
           "load_output_layer_shard", "teacher_identity", "unpipelined_groups"]


def _teacher_dir_and_arch(teacher_load: str,
                          teacher_args: str | None) -> tuple[str, GPTArchConfig]:
    """This project's checkpoint (``model_config.json``), else a Megatron-LM one."""
    try:
        directory = resolve_model_dir(teacher_load)
    except ValueError:
        directory = megatron_lm_teacher_dir(teacher_load)
        if directory is None:
            raise
        return directory, megatron_lm_teacher_arch(directory, teacher_args)
    if teacher_args:
        raise ValueError(f"--kd-teacher-args is for Megatron-LM checkpoints; {directory!r} "
                         f"has its architecture in {MODEL_CONFIG_FILE}")
    return directory, read_checkpoint_arch(directory)


def check_teacher(teacher_load: str, *, seq_length: int,
                  teacher_args: str | None = None) -> tuple[str, GPTArchConfig]:
    """``(directory, arch)`` of a teacher checkpoint, checked: its tensors fit its
    architecture and it is built for ``seq_length``. ``teacher_load`` may be a training
    checkpoint root (its newest iteration is taken), or a Megatron-LM ``torch_dist`` checkpoint
    whose architecture is ``teacher_args`` (Megatron-LM flags, or a file of them) or, without
    them, its saved arguments (:mod:`megatron_kd.integration.megatron_lm_checkpoint`). The
    layout the teacher runs with is the caller's to check
    (:func:`megatron_kd.arch.check_layout`, in the caller's role)."""
    if not os.path.isdir(teacher_load):
        raise ValueError(f"--kd-teacher-load {teacher_load!r} is not a directory")
    directory, arch = _teacher_dir_and_arch(teacher_load, teacher_args)
    check_checkpoint_tensors(directory, arch)
    if arch.max_position_embeddings < seq_length:
        raise ValueError(f"teacher max_position_embeddings {arch.max_position_embeddings} < "
                         f"--seq-length {seq_length}")
    return directory, arch


def unpipelined_groups(pg_collection: ProcessGroupCollection | None = None):
    """``(pg_collection, single)``: Megatron's groups (``pg_collection`` or ``parallel_state``'s)
    with a pipeline "group" of this rank alone, for a teacher that has every layer wherever it
    is. ``single`` is that new group (the caller destroys it when done). Collective: every rank
    of the world creates the one-rank groups in one call."""
    pgc = (ProcessGroupCollection.use_mpu_process_groups() if pg_collection is None
           else copy.copy(pg_collection))
    single, _ = dist.new_subgroups(group_size=1)
    pgc.pp = single
    return pgc, single


def build_frozen_teacher(arch: GPTArchConfig, load_dir: str, *, dtype: torch.dtype,
                         pg_collection: ProcessGroupCollection | None = None,
                         pre_process: bool = True, post_process: bool = True,
                         seed: int | None = None, replicated: bool = False, keep: bool = True,
                         sequence_parallel: bool = False, attention: str = "auto"):
    """Build, load and freeze a teacher ``GPTModel`` (collective: its ranks load together).

    Args:
        arch: the teacher's architecture (from its checkpoint's ``model_config.json``).
        load_dir: the teacher checkpoint.
        dtype: parameter dtype (the fused loss computes in fp32 either way).
        pg_collection: explicit process groups (e.g. :func:`unpipelined_groups`); None: Megatron's
            ``parallel_state``.
        pre_process / post_process: this pipeline stage's ends of the teacher.
        seed: seeds Megatron's model-parallel RNG before building (needed in a process where it
            was never seeded; the weights come from the checkpoint either way).
        replicated: several ranks that Megatron's groups call replicas load the same shard
            (a teacher on every pipeline stage of a student).
        keep: False loads (so the collective load completes) and returns None.
        sequence_parallel: built for sequence parallelism over its TP group (it then takes the
            whole sequence and returns this TP rank's ``[s/tp, b, h]`` slice of it).
        attention: the core attention of its layers (``--attention-backend``: ``auto``,
            ``sdpa`` or ``unfused``; :func:`~megatron_kd.integration.gpt.build_gpt_model`).

    Returns the model (output layer bypassed on the last stage, eval mode, frozen) or None.
    """
    with _random_state_kept():
        teacher = build_gpt_model(arch, pg_collection=pg_collection, pre_process=pre_process,
                                  post_process=post_process, params_dtype=dtype, seed=seed,
                                  perform_initialization=False,
                                  sequence_parallel=sequence_parallel, attention=attention)
    load_model_checkpoint(teacher, load_dir, arch=arch,
                          validate_access_integrity=not replicated)
    if not keep:
        return None
    if post_process:
        bypass_output_layer(teacher)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@contextlib.contextmanager
def _random_state_kept():
    """The process's random streams as they were before: building a teacher draws nothing the
    student will see. ``perform_initialization=False`` is not enough: Megatron-Core's Gated
    DeltaNet initialises its decay and convolution parameters regardless (0.16.1, 0.19.2), and
    in Megatron-LM's ``pretrain_gpt.py`` the teacher is built before the student, whose
    initial weights then moved. Keeps the CPU and current GPU generators and Megatron's
    model-parallel tracker."""
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states() if tracker.is_initialized() else None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    if states is not None:
        tracker.set_states(states)


def full_sequence_forward(model, *, is_last: bool, sp_group=None, cp_group=None):
    """``forward(tokens [b, s]) -> [s, b, h]`` final hidden states of the whole sequences on the
    last pipeline stage (None elsewhere), for a frozen teacher built in its own layout (a
    ``teacher serve`` replica, a ``cache build``): Megatron-Core's forward-only pipeline schedule
    over one microbatch of the whole batch. ``sp_group``: the model is sequence-parallel over
    this TP group; ``cp_group``: context-parallel over this group (each rank runs its
    load-balanced positions). The slices are gathered into the whole sequence, in order, on
    every rank of the stage, and a sequence the split does not divide is padded at its end for
    the forward (causal: the padding changes no earlier position) and cut back after."""
    forward_backward = get_forward_backward_func()
    cp = cp_group.size() if cp_group is not None else 1
    split = sequence_parts(tp=sp_group.size() if sp_group is not None else 1, cp=cp,
                           sequence_parallel=sp_group is not None)

    def forward(tokens: torch.Tensor):
        batch, given = tokens.shape
        if given % split:
            tokens = torch.nn.functional.pad(tokens, (0, split - given % split))
        seq = tokens.shape[1]
        position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
        if cp > 1:  # this rank's load-balanced positions of every sequence
            rows = cp_positions(seq, cp_group.rank(), cp, tokens.device)
            tokens, position_ids = tokens[:, rows], position_ids[:, rows]
        out = []

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            output = model(item["tokens"], item["position_ids"], None)

            def keep(output_tensor):
                hidden = gather_sequence(to_sbh(output_tensor).detach(), sp_group)
                out.append(gather_positions(hidden, cp_group) if cp > 1 else hidden)
                return torch.zeros((), device=output_tensor.device), {}

            return output, keep

        with device_context(), torch.no_grad():
            forward_backward(forward_step_func=forward_step,
                             data_iterator=iter([{"tokens": tokens, "position_ids": position_ids}]),
                             model=[model], num_microbatches=1, seq_length=seq,
                             micro_batch_size=batch, forward_only=True)
        return out[0][:given] if is_last else None

    return forward


def load_output_layer_shard(teacher_dir: str, arch: GPTArchConfig, dtype: torch.dtype,
                            tp_size: int | None = None) -> torch.Tensor:
    """This TP rank's ``[padded_vocab / tp, h_t]`` shard of the teacher's output layer.

    Reads only that tensor from the teacher's ``dist_checkpointing`` checkpoint (the input
    embedding when the teacher ties it to the output layer). Collective over the default group.
    ``tp_size``: the tensor-parallel size of the shard (default: ``parallel_state``'s). Read on
    the host, returned on the compute device (where the loss multiplies it).
    """
    if tp_size is None:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    key = "embedding.word_embeddings.weight" if arch.tie_embeddings else "output_layer.weight"
    local = torch.empty(arch.padded_vocab_size // tp_size, arch.hidden_size, dtype=dtype)
    request = {key: make_tp_sharded_tensor_for_checkpoint(local, key)}
    loaded = dist_checkpointing.load(request, teacher_dir, validate_access_integrity=False)
    return loaded[key].to(device=compute_device(), dtype=dtype)


def teacher_identity(teacher_dir: str, arch: GPTArchConfig, dtype: str) -> dict:
    """What a teacher service serves and a student checks at connect: the checkpoint (a hash of
    its ``model_config.json`` and of every file's name and size: cheap, the weights are not
    read), the true and padded vocabulary, the hidden size, the parameter dtype and the
    tokenizer (sha256 of the checkpoint's ``tokenizer.json``, if it has one). The architecture
    is hashed as built (a Megatron-LM checkpoint has no ``model_config.json``)."""
    digest = hashlib.sha256()
    root = os.path.abspath(teacher_dir)
    digest.update(json.dumps(arch.to_dict(), sort_keys=True).encode())
    for directory, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(directory, name)
            digest.update(f"{os.path.relpath(path, root)}\0{os.path.getsize(path)}\0".encode())
    tokenizer = os.path.join(root, "tokenizer.json")
    tokenizer_sha = None
    if os.path.isfile(tokenizer):
        with open(tokenizer, "rb") as f:
            tokenizer_sha = hashlib.sha256(f.read()).hexdigest()
    return {"checkpoint": digest.hexdigest()[:16], "vocab_size": arch.vocab_size,
            "padded_vocab_size": arch.padded_vocab_size, "hidden_size": arch.hidden_size,
            "dtype": dtype, "tokenizer_sha256": tokenizer_sha}
