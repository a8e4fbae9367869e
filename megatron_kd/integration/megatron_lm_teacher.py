"""The teacher's side of the Megatron-LM entry points (:mod:`megatron_kd.integration.megatron_lm`):
Megatron-LM's data iterator read ahead, the tokens of a last pipeline stage that Megatron-LM
calls without them, the colocated teacher's forward, and the disaggregated teacher's client
and its scalars in Megatron-LM's own writers."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megatron_kd.integration.groups import collective_device
from megatron_kd.integration.output_layer import to_sbh
from megatron_kd.integration.teacher import connect_teacher
from megatron_kd.teacher.lookahead import Lookahead

__all__ = ["lookahead", "megatron_lm_args", "microbatches_per_step", "start_client",
           "teacher_hidden", "write_teacher_scalars"]


def megatron_lm_args() -> argparse.Namespace:
    # Waits until called: megatron.training is Megatron-LM itself, not megatron-core.
    from megatron.training import get_args

    return get_args()


def lookahead(state, data_iterator, training: bool) -> Lookahead:
    """The chunk's training iterator, read ahead (one object for the run; evaluation iterators
    are wrapped only to see their current item)."""
    if training:
        if state.lookahead is None or state.lookahead.source is not data_iterator:
            state.lookahead = Lookahead(data_iterator)
        return state.lookahead
    return Lookahead(data_iterator)


def _microbatch_tokens(state, recorder, current) -> torch.Tensor:
    """The microbatch's token ids on every TP rank of this stage. On the last of several
    pipeline stages Megatron-LM calls the model without them and only TP rank 0 reads the data
    iterator: its item's tokens are broadcast over the TP group."""
    shape = tuple(recorder.labels.shape)
    tokens = current["tokens"] if current is not None else None
    group = state.tp_group
    if group is None or group.size() == 1:
        if tokens is None:
            raise RuntimeError("no tokens for the teacher: the model was called without them and "
                               "there is no data iterator on this rank")
        return tokens
    buf = tokens if tokens is not None and group.rank() == 0 else \
        torch.empty(shape, dtype=torch.int64, device=recorder.labels.device)
    buf = buf.to(device=recorder.labels.device, dtype=torch.int64).contiguous()
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    return buf


def teacher_hidden(state, recorder, training: bool, look: Lookahead | None = None):
    """``[s, b, h_t]`` teacher hidden states of this microbatch, or None (no teacher, or
    evaluation of a disaggregated run: the student's CE only). ``look``: the data iterator the
    forward step read this microbatch from (training or evaluation), where this rank has one."""
    if state.kd.mode == "disaggregated":
        if not training:
            return None
        n = state.microbatches
        per_step = microbatches_per_step()
        return state.client.hidden(n // per_step, n % per_step)
    if state.teacher is None:
        return None
    args, kwargs = recorder.inputs
    with torch.no_grad():
        if args and args[0] is not None:  # the model's own inputs (first stage, or no PP)
            return to_sbh(state.teacher(*args, **kwargs))
        current = look.current if look is not None else None
        tokens = _microbatch_tokens(state, recorder, current)
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return to_sbh(state.teacher(tokens, position_ids, None))


def write_teacher_scalars(state) -> None:
    """The step's teacher traffic and waits (this rank's client) into Megatron-LM's own
    TensorBoard and W&B writers, where this rank has them (Megatron-LM's last rank)."""
    stats = state.client.take_step_stats()
    try:
        # Megatron-LM's training package: present only inside a Megatron-LM run
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:  # only megatron-core: nobody to write to
        return
    scalars = {"kd/wire-bytes": stats["bytes"], "kd/teacher-wait-s": stats["wait_s"],
               "kd/ring-occupancy": stats["occupancy"],
               "kd/live-replicas": state.client.live_replicas(),
               "kd/failovers": len(state.client.failovers)}
    scalars = {k: float(v) for k, v in scalars.items() if v is not None}
    iteration = getattr(megatron_lm_args(), "curr_iteration", None)
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


def start_client(state) -> None:
    """Connect the teacher client (the first training microbatch): TP rank 0 sends requests
    from the look-ahead over its data iterator."""
    args = megatron_lm_args()
    per_step = microbatches_per_step()
    look = state.lookahead

    def schedule():
        for n, item in enumerate(look.ahead()):
            yield n // per_step, n % per_step, (), item["tokens"]

    state.client = connect_teacher(
        state.kd, state.teacher_arch, run=state.run, dp_rank=ps.get_data_parallel_rank(),
        tp_group=state.tp_group, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, schedule=schedule() if look is not None else None,
        device=collective_device(), max_samples=1, log=print)
