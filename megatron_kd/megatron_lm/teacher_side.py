"""The teacher's side of the Megatron-LM entry points (:mod:`megatron_kd.megatron_lm`):
Megatron-LM's data iterator read ahead, each microbatch as the run's
:class:`~megatron_kd.modes.source.TeacherSource` takes it (the tokens of a last
pipeline stage that Megatron-LM calls without them included, cut to this context-parallel
rank's chunks as ``get_batch`` cuts the rest), and the source's statistics in Megatron-LM's own
writers.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from megatron.core import rerun_state_machine as rsm
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megatron_kd.integration.context_parallel import cp_positions
from megatron_kd.modes.source import Microbatch, TeacherInputs
from megatron_kd.teacher.lookahead import Lookahead

__all__ = ["lookahead", "megatron_lm_args", "microbatches_per_step", "run_again",
           "start_source", "teacher_inputs", "write_teacher_scalars"]


def megatron_lm_args() -> argparse.Namespace:
    # Waits until called: megatron.training is Megatron-LM itself, not megatron-core.
    from megatron.training import get_args

    return get_args()


def lookahead(state, data_iterator, training: bool) -> Lookahead:
    """The chunk's training iterator, read ahead (one object for the run; evaluation iterators
    are wrapped only to see their current item). With Megatron-Core's rerun state machine on,
    a step it runs again is given the same microbatches (:class:`Lookahead`)."""
    if training:
        if state.lookahead is None or state.lookahead.source is not data_iterator:
            state.lookahead = Lookahead(data_iterator, replayable=_rerun_machine() is not None)
        return state.lookahead
    return Lookahead(data_iterator)


def _rerun_machine():
    """Megatron-Core's rerun state machine where it may run a step again (``--rerun-mode``
    other than ``disabled``), else None. A run that started none (``megatron-kd train``, a
    test) has none: ``get_rerun_state_machine()`` would start a default one as a side effect,
    which Megatron-LM's own ``initialize_rerun_state_machine`` later refuses."""
    machine = rsm._GLOBAL_RERUN_STATE_MACHINE  # read, not started
    return None if machine is None or machine.get_mode() == rsm.RerunMode.DISABLED else machine


def run_again(state) -> bool:
    """Whether this training microbatch belongs to a step that Megatron-Core's rerun state
    machine runs again (in place), read off the machine on every rank alike (ranks without a
    data iterator included). At a step's first run the step's first microbatch is noted and the
    kept teacher outputs are dropped; when the step runs again the microbatch count steps back
    to it, so each microbatch is the same ``(step, index)`` as in the first run."""
    machine = _rerun_machine()
    if machine is None:
        return False
    again = machine.state == rsm.RerunState.RERUNNING_IN_PLACE
    if not again and state.rerun_iteration != machine.current_iteration:
        state.rerun_iteration, state.rerun_first = machine.current_iteration, state.microbatches
        state.rerun_rewound = False
        state.kept.clear()
    elif again and not state.rerun_rewound:
        state.microbatches, state.rerun_rewound = state.rerun_first, True
    return again


def _microbatch_tokens(state, recorder, current) -> torch.Tensor:
    """The microbatch's ``[b, s]`` token ids (the whole sequence) on every TP rank of this
    stage. On the last of several pipeline stages Megatron-LM calls the model without them and
    only TP rank 0 reads the data iterator: its item's tokens are broadcast over the TP group.
    ``s`` is the sequence of the labels Megatron-LM's ``get_batch`` gave, times the
    context-parallel size (it gave this rank's chunks of it)."""
    cp = state.cp_group.size() if state.cp_group is not None else 1
    shape = (recorder.labels.shape[0], recorder.labels.shape[1] * cp)
    device = recorder.labels.device
    tokens = current["tokens"] if current is not None else None
    group = state.tp_group
    if group is None or group.size() == 1:
        if tokens is None:
            raise RuntimeError("no tokens for the teacher: the model was called without them and "
                               "there is no data iterator on this rank")
        buf = tokens
    else:
        buf = tokens if tokens is not None and group.rank() == 0 else \
            torch.empty(shape, dtype=torch.int64, device=device)
        buf = buf.to(device=device, dtype=torch.int64).contiguous()
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    if tuple(buf.shape) != shape:
        raise RuntimeError(f"the data iterator's tokens {tuple(buf.shape)} are not the "
                           f"microbatch's sequence {shape} (labels {tuple(recorder.labels.shape)}"
                           f" x context-parallel size {cp})")
    # the item is on the host where Megatron-LM's get_batch moves its copy to the GPU
    return buf.to(device=device, dtype=torch.int64)


def _model_inputs(state, recorder, look: Lookahead | None):
    """The teacher's call: the model's own inputs (first stage, or no PP), else the data
    iterator's tokens (broadcast over TP), this context-parallel rank's chunks of them
    (Megatron-LM's ``get_batch_on_this_cp_rank`` split), with their positions."""
    args, kwargs = recorder.inputs
    if args and args[0] is not None:
        return args, kwargs
    current = look.current if look is not None else None
    tokens = _microbatch_tokens(state, recorder, current)
    cp_group = state.cp_group
    if cp_group is None or cp_group.size() == 1:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
    else:
        positions = cp_positions(tokens.shape[1], cp_group.rank(), cp_group.size(),
                                 tokens.device)
        tokens = tokens.index_select(1, positions)
    return (tokens, positions.expand_as(tokens), None), {}


def teacher_inputs(state, recorder, training: bool, look: Lookahead | None = None,
                   again: bool = False) -> TeacherInputs:
    """The teacher's side of this microbatch from the run's source (none without a teacher, or
    in a disaggregated or offline evaluation: the student's CE only). ``look``: the data
    iterator the forward step read this microbatch from (training or evaluation), where this
    rank has one. An offline source reads the whole sequences' token ids (the data iterator's,
    broadcast over TP: collective over the TP group, on every TP rank alike) and, with context
    parallelism, keeps this rank's positions of the cached rows. ``again``: the microbatch of
    a step run again (:func:`run_again`); a streamed source's outputs (a disaggregated
    teacher's) are then those kept from the step's first run."""
    n, per_step = state.microbatches, microbatches_per_step()
    current = look.current if look is not None else None
    mb = Microbatch(step=n // per_step, index=n % per_step,
                    tokens=lambda: _microbatch_tokens(state, recorder, current),
                    positions=_cp_rank_positions(state, recorder),
                    model_inputs=lambda: _model_inputs(state, recorder, look))
    keep = training and state.source.streamed and _rerun_machine() is not None
    if keep and again:  # the step run again: its first run's teacher outputs
        try:
            return state.kept[(mb.step, mb.index)]
        except KeyError:
            raise RuntimeError(f"rerun: no teacher outputs kept for microbatch {mb.index} of "
                               f"step {mb.step} (kept: {sorted(state.kept)})") from None
    inputs = state.source.inputs(mb, training=training)
    if keep:
        state.kept[(mb.step, mb.index)] = inputs
    return inputs


def _cp_rank_positions(state, recorder) -> torch.Tensor | None:
    """This context-parallel rank's positions of the whole sequence, in the order
    ``get_batch`` gave them (None: no context parallelism)."""
    cp_group = state.cp_group
    if cp_group is None or cp_group.size() == 1:
        return None
    seq = recorder.labels.shape[1] * cp_group.size()
    return cp_positions(seq, cp_group.rank(), cp_group.size(), recorder.labels.device)


class _Schedule:
    """The training microbatches read ahead, an iterable whose iterator is made anew each time
    (several teachers' :class:`~megatron_kd.modes.mixture.Mixture` hands it to each source).
    Each iterator reads :meth:`Lookahead.ahead`, which hands each item to one reader: only
    one source may iterate it (a disaggregated teacher's; the colocated and offline sources
    read each microbatch in its forward step), which
    :func:`~megatron_kd.megatron_lm.checks.check_megatron_teachers` ensures."""

    def __init__(self, look: Lookahead | None, per_step: int) -> None:
        self._look, self._per_step = look, per_step
        self._iterated = False

    def __iter__(self):
        if self._look is None:  # no data iterator on this rank: nothing to send
            return iter(())
        if self._iterated:
            raise RuntimeError("the data iterator's look-ahead is read by one teacher only")
        self._iterated = True
        return self._microbatches()

    def _microbatches(self):
        per_step = self._per_step
        for n, item in enumerate(self._look.ahead()):
            yield Microbatch(step=n // per_step, index=n % per_step, tokens=item["tokens"])


def start_source(state) -> None:
    """Start the run's teacher source at the first training microbatch: a disaggregated
    teacher's requests come from the look-ahead over the data iterator (TP rank 0 sends)."""
    state.source.start(_Schedule(state.lookahead, microbatches_per_step()))
    state.stats_time = time.perf_counter()


def write_teacher_scalars(state) -> None:
    """The step's teacher statistics (this rank's source: Megatron-LM writes from its last
    rank, with that rank's values) into Megatron-LM's own TensorBoard and W&B writers, where
    this rank has them; the same ``kd/`` scalars as ``megatron-kd train``'s."""
    now = time.perf_counter()
    # the source's record, named as it is written (rates over the time since the last write)
    scalars = state.source.step_stats(None).scalars(now - state.stats_time)
    state.stats_time = now
    if not scalars:
        return
    try:
        # Megatron-LM's training package: present only inside a Megatron-LM run
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:  # only megatron-core: nobody to write to
        return
    iteration = getattr(megatron_lm_args(), "curr_iteration", None)  # Megatron-LM's own field
    step = (iteration if iteration is not None else
            state.microbatches // microbatches_per_step() - 1) + 1
    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)
    if wandb_writer is not None:
        wandb_writer.log(scalars, step)


def microbatches_per_step() -> int:
    try:
        return get_num_microbatches()
    except (AssertionError, AttributeError, TypeError):
        return 1  # not set up (only megatron-core): the step number is then the microbatch's
