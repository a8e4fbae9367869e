"""Training cases shared by the end-to-end tests: the tiny teacher and student, the gloo-rank
cases that make a teacher and train, and an independent dense reference of the KD loss.

Every run is a tiny model (2 layers, h 32, vocabulary 500 padded to 512, sequence 32) on
synthetic tokens, a few seconds each.
"""

import types

import torch

from megatron_kd.loss import DenseTeacher

# init std 0.25: a peaked random teacher, so the KD term is far from 0.
TEACHER_ARCH = {"num_layers": 2, "hidden_size": 48, "num_attention_heads": 4,
                "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": 500,
                "padded_vocab_size": 512, "max_position_embeddings": 64, "tie_embeddings": True,
                "init_method_std": 0.25}

_STUDENT_FLAGS = {"--num-layers": "2", "--hidden-size": "32", "--num-attention-heads": "4",
                  "--num-query-groups": "2", "--ffn-hidden-size": "64", "--seq-length": "32",
                  "--micro-batch-size": "2", "--global-batch-size": "4", "--lr": "1e-2",
                  "--lr-warmup-iters": "1", "--mock-data": None, "--no-progress": None}


def student_argv(**overrides):
    """The tiny student's flags; ``overrides`` maps flag names (``num_attention_heads``) to a
    value, or None to drop the flag."""
    flags = dict(_STUDENT_FLAGS)
    for name, value in overrides.items():
        key = "--" + name.replace("_", "-")
        if value is None:
            flags.pop(key, None)
        else:
            flags[key] = str(value)
    argv = []
    for key, value in flags.items():
        argv += [key] if value is None else [key, value]
    return argv


STUDENT = student_argv()

LOG_FIELDS = ("step", "loss", "kd_loss", "lm_loss", "lr", "tokens_per_s", "peak_mem_bytes")


# --- cases (run on every rank) --------------------------------------------------------------

def case_make_teacher(ctx, directory, arch_kw, seed=5):
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = GPTArchConfig(**arch_kw)
    with model_parallel(tp=2):
        save_model_checkpoint(build_gpt_model(arch, seed=seed), arch, directory)


def case_import(ctx, hf_path, save_dir, pad_for_tp=1):
    """A Hugging Face checkpoint imported to a Megatron-Core one at TP 1 (every rank takes part
    in the collective ``dist_checkpointing`` save); returns the imported architecture as a
    dict."""
    from megatron.core import parallel_state

    from megatron_kd.hf.importer import import_hf

    parallel_state.initialize_model_parallel(1, 1)
    try:
        return import_hf(hf_path, save_dir, pad_for_tp=pad_for_tp).to_dict()
    finally:
        parallel_state.destroy_model_parallel()


def import_hf_model(pool, tmp, make, vocab: int, **kw) -> str:
    """A tiny model of transformers' own class ``make`` (``support.hf_models``), imported by
    ``pool`` at TP 1 into ``tmp/megatron``; returns that directory."""
    hf_path, _, _ = make(tmp, vocab=vocab, **kw)
    save_dir = str(tmp / "megatron")
    pool.run(case_import, hf_path, save_dir)
    return save_dir


def cache_build_argv(out, teacher, *, topk, seq, iters, global_batch, encoding="fp32",
                     samples_per_shard=4, tp=1, data=("--mock-data",), extra=()):
    """``megatron-kd cache build`` flags for a tiny run at micro-batch 2: the cache of ``iters``
    steps of ``global_batch`` samples of ``seq`` tokens; ``extra``: further flags (the
    teacher's own, the loss window, a seed)."""
    return ["cache", "build", "--out", str(out), "--kd-teacher-load", str(teacher),
            "--kd-topk", str(topk), "--logprob-encoding", encoding,
            "--samples-per-shard", str(samples_per_shard), "--tensor-model-parallel-size",
            str(tp), "--seq-length", str(seq), "--micro-batch-size", "2",
            "--train-iters", str(iters), "--global-batch-size", str(global_batch), *data,
            *extra]


def case_cache_build(ctx, argv):
    """``megatron-kd cache build`` with ``argv`` on every rank; fails unless it exits 0."""
    from megatron_kd.cli import main

    assert main(argv) == 0


def case_train(ctx, argv, dense=False):
    """``megatron-kd train`` with ``argv``; its summary. ``dense``: on the dense reference
    instead of the fused loss, the loss values read off the run's configuration (True) or the
    test's own literals (a dict: :func:`literal_dense_kd_loss`)."""
    from megatron_kd.commands.train import parse_args, train

    if isinstance(dense, dict):
        loss_fn = literal_dense_kd_loss(dense)
    else:
        loss_fn = dense_kd_loss if dense else None
    summary = train(parse_args(argv), loss_fn=loss_fn)
    return summary


def case_train_slowly(ctx, argv, delay_s, holds=(), teacher_ahead=False):
    """Train, each step taking at least ``delay_s`` longer (a slow student).

    ``holds``: ``(path, steps)`` pairs: once ``steps`` steps are done, no further step starts
    while the file ``path`` exists (how a test parks the run at a known step to act on it;
    RuntimeError after 300 s). ``teacher_ahead``: each microbatch's teacher hidden states are
    asked for only once every prefetched response has arrived (a teacher that is always ahead,
    without racing it). The summary also holds ``step_wall_s``: each step's time measured here,
    around the trainer's step, apart from the trainer's own clock."""
    import os
    import time

    from megatron_kd.teacher.client import TeacherClient
    from megatron_kd.training import trainer as trainer_mod

    original, original_hidden = trainer_mod.Trainer.train_step, TeacherClient.hidden
    walls = []

    def until(done, what):
        deadline = time.monotonic() + 300
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"still waiting after 300 s: {what}")
            time.sleep(0.01)

    def slow(self, consumed):
        t0 = time.perf_counter()
        time.sleep(delay_s)
        done = consumed // self.run.global_batch_size
        for path, steps in holds:
            if done >= steps:
                until(lambda held=path: not os.path.exists(held),
                      f"{path} held after step {steps}")
        try:
            return original(self, consumed)
        finally:
            walls.append(time.perf_counter() - t0)

    def hidden_once_arrived(self, step, microbatch, sample_ids=None):
        until(lambda: self._arrived() == len(self.outstanding),
              f"the teacher's responses ahead of step {step} microbatch {microbatch}")
        return original_hidden(self, step, microbatch, sample_ids)

    trainer_mod.Trainer.train_step = slow
    if teacher_ahead:
        TeacherClient.hidden = hidden_once_arrived
    try:
        return {**case_train(ctx, argv), "step_wall_s": walls}
    finally:
        trainer_mod.Trainer.train_step, TeacherClient.hidden = original, original_hidden


def check_flags(argv, world_size):
    """``megatron-kd train``'s checks of ``argv`` on a world of ``world_size`` ranks: the
    :class:`~megatron_kd.training.run_checks.CheckedRun`, or their ``ValueError``."""
    from megatron_kd.commands.train import parse_args
    from megatron_kd.training.run_checks import check_run
    from megatron_kd.training.run_config import RunConfig

    return check_run(RunConfig.from_args(parse_args(argv)), world_size)


def case_plan_error(ctx, argv):
    """Run ``train``; return the ValueError message (and that no step ran)."""
    from megatron_kd.commands import train as train_mod

    steps = []
    original = train_mod.Trainer.train_step

    def spy(self, consumed):  # pragma: no cover - must never run
        steps.append(consumed)
        return original(self, consumed)

    train_mod.Trainer.train_step = spy
    try:
        train_mod.train(train_mod.parse_args(argv))
    except ValueError as e:
        return str(e), len(steps)
    finally:
        train_mod.Trainer.train_step = original
    return None, len(steps)


def dense_kd_loss(student_hidden, student_weight, teacher=None, *, labels=None, loss_mask=None,
                  config=None, tp_group=None, terms_out=None):
    """Full logits through Megatron's own TP mappings, then torch log_softmax: the textbook KD.
    ``vocab_parallel_kd_loss``'s signature; ``teacher`` a ``DenseTeacher`` or None.

    ``copy_to_tensor_model_parallel_region`` sums the hidden-state gradient over the vocabulary
    shards and ``gather_from_tensor_model_parallel_region`` all-gathers the logits (and splits
    their gradient), exactly as Megatron's ColumnParallelLinear with gathered output does.
    """
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    assert teacher is None or isinstance(teacher, DenseTeacher), type(teacher)  # dense only
    vocab = config.vocab_size
    t = config.temperature

    def full_logits(hidden, weight):
        h = copy_to_tensor_model_parallel_region(hidden.float(), group=tp_group)
        local = h @ weight.float().t()
        return gather_from_tensor_model_parallel_region(local, group=tp_group)[..., :vocab]

    mask = loss_mask.float()
    z_s = full_logits(student_hidden, student_weight)
    kd_sum = torch.zeros((), dtype=torch.float32)
    ce_sum = torch.zeros((), dtype=torch.float32)
    if teacher is not None:
        with torch.no_grad():
            z_t = full_logits(teacher.hidden, teacher.weight)
        log_p_s = torch.log_softmax(z_s / t, dim=-1)
        log_p_t = torch.log_softmax(z_t / t, dim=-1)
        if config.kind == "forward_kl":
            kd = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)
        elif config.kind == "reverse_kl":
            kd = (log_p_s.exp() * (log_p_s - log_p_t)).sum(-1)
        else:
            b = config.beta
            m = b * log_p_t.exp() + (1 - b) * log_p_s.exp()
            log_m = m.log()
            kd = (b * (log_p_t.exp() * (log_p_t - log_m)).sum(-1)
                  + (1 - b) * (log_p_s.exp() * (log_p_s - log_m)).sum(-1))
        kd_sum = (t * t) * (mask * kd).sum()
    if labels is not None:
        ce = torch.nn.functional.cross_entropy(
            z_s.reshape(-1, vocab), labels.reshape(-1), reduction="none",
            ignore_index=config.ignore_index).view_as(mask)
        ce_sum = (mask * ce).sum()
    if terms_out is not None:  # unweighted, as the fused loss reports them
        terms_out["kd_sum"] = kd_sum.detach()
        terms_out["ce_sum"] = ce_sum.detach()
    return config.kd_weight * kd_sum + config.ce_weight * ce_sum, mask.sum()


#: The loss values :func:`dense_kd_loss` reads off its ``config``.
DENSE_LOSS_FIELDS = ("kind", "temperature", "beta", "kd_weight", "ce_weight", "vocab_size",
                     "ignore_index")


def literal_dense_kd_loss(values: dict):
    """:func:`dense_kd_loss` on ``values`` (every one of :data:`DENSE_LOSS_FIELDS`, literals a
    test states) instead of the configuration the run parsed from its flags: a flag read into
    the wrong field, or into none, then makes the fused loss (on the parsed configuration) and
    this reference differ, where a reference on the parsed configuration would agree with it.
    For training losses only (evaluation's teacher-LM report passes a configuration of its
    own, which this would ignore)."""
    if set(values) != set(DENSE_LOSS_FIELDS):
        raise ValueError(f"the dense reference needs exactly {DENSE_LOSS_FIELDS}, got "
                         f"{sorted(values)}")
    stated = types.SimpleNamespace(**values)

    def loss(*args, config=None, terms_out=None, **kwargs):
        assert terms_out is not None, "a training loss (with terms_out) only"
        return dense_kd_loss(*args, config=stated, terms_out=terms_out, **kwargs)

    return loss


def step_losses(summary):
    """The per-step losses of a training summary."""
    return [r["loss"] for r in summary["steps"]]


def case_checkpoint_logits(ctx, directory, tokens):
    """``[b, s, vocab_size]`` full-vocabulary logits of the model in ``directory`` (a model
    checkpoint, or a ``--save`` root's newest iteration) on ``tokens``, at TP 1 in fp32, its
    output layer run as a plain model runs it (no loss, no bypass)."""
    from megatron_kd.integration.checkpoint import (
        load_model_checkpoint,
        read_checkpoint_arch,
        resolve_model_dir,
    )
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    model_dir = resolve_model_dir(directory)
    arch = read_checkpoint_arch(model_dir)
    with model_parallel(tp=1):
        model = build_gpt_model(arch, seed=0)
        load_model_checkpoint(model, model_dir)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad(), device_context():
            logits = model.eval()(tokens, positions, None)
    return logits[..., :arch.vocab_size]
