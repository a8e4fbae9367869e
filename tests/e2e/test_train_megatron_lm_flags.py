"""The Megatron-LM flags of a long run in ``megatron-kd train``, each by its effect on real
tiny runs (two gloo ranks, data-parallel):

* ``--overlap-grad-reduce``: the same losses as without it (the bucketed reduction only moves
  in time);
* ``--recompute-activations``: Megatron-LM's spelling of selective recompute, the same losses;
* ``--eod-mask-loss`` / ``--reset-position-ids`` on preprocessed text: the loss mask the loss
  takes is zero exactly on the end-of-document tokens, and the position ids the student *and*
  the colocated teacher are given restart after each of them;
* a weighted ``--data-path`` blend trains;
* ``--exit-duration-in-mins``: the run stops at a step, saves, logs a resumable exit record, and
  the resumed run's losses are the uninterrupted run's; ``--no-load-optim`` /
  ``--no-load-rng`` resume without those states;
* what it does not take: ``--ckpt-format torch``, ``--transformer-impl transformer_engine``
  without Transformer Engine, and the Megatron-LM flags of ``NOT_TAKEN``, each refused naming
  the flag; docs/megatron_lm_flags.md's table agrees with the parser.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.train_cases import STUDENT, case_train, check_flags, step_losses

REPO = Path(__file__).resolve().parents[2]
ITERS = ["--train-iters", "4", "--eval-interval", "100", "--eval-iters", "0"]


def _losses(summary) -> list[float]:
    return step_losses(summary)


def test_overlap_grad_reduce_gives_the_same_losses(pool, teacher):
    argv = STUDENT + ITERS + ["--kd-teacher-load", teacher, "--kd-ce-weight", "0.2"]
    plain = pool.run(case_train, argv)[0]
    overlapped = pool.run(case_train, argv + ["--overlap-grad-reduce"])[0]
    assert plain["dp"] == 2
    assert _losses(overlapped) == pytest.approx(_losses(plain), rel=1e-6)
    assert [s["grad_norm"] for s in overlapped["steps"]] == pytest.approx(
        [s["grad_norm"] for s in plain["steps"]], rel=1e-6)


def test_recompute_activations_is_selective_recompute(pool, teacher):
    argv = STUDENT + ITERS + ["--kd-teacher-load", teacher]
    assert check_flags(argv + ["--recompute-activations"], 2).layout.recompute == "selective"
    with pytest.raises(ValueError, match="--recompute-activations is selective"):
        check_flags(argv + ["--recompute-activations", "--recompute-granularity", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "1"], 2)
    plain = pool.run(case_train, argv)[0]
    recomputed = pool.run(case_train, argv + ["--recompute-activations"])[0]
    assert _losses(recomputed) == pytest.approx(_losses(plain), rel=1e-6)


# --- documents: masks and positions ------------------------------------------------------------

def case_train_seeing_inputs(ctx, argv):
    """Train; return the summary, every ``(tokens, position_ids)`` each GPTModel forward got
    (student and teacher alike, by the model's own role), and every loss mask the KD loss got
    with its tokens."""
    from megatron.core.models.gpt import GPTModel

    from megatron_kd.training import trainer as trainer_mod

    seen = {"forward": [], "masks": []}
    forward, make = GPTModel.forward, trainer_mod.make_kd_loss_func
    tokens_of_step = {}

    def spy_forward(self, input_ids, position_ids, *args, **kwargs):
        role = "teacher" if not any(p.requires_grad for p in self.parameters()) else "student"
        seen["forward"].append((role, input_ids.tolist(), position_ids.tolist()))
        tokens_of_step["last"] = input_ids
        return forward(self, input_ids, position_ids, *args, **kwargs)

    def spy_make(*args, loss_mask, **kwargs):
        seen["masks"].append((tokens_of_step["last"].tolist(), loss_mask.tolist()))
        return make(*args, loss_mask=loss_mask, **kwargs)

    GPTModel.forward, trainer_mod.make_kd_loss_func = spy_forward, spy_make
    try:
        summary = case_train(ctx, argv)
    finally:
        GPTModel.forward, trainer_mod.make_kd_loss_func = forward, make
    return summary, seen


def case_save_text_teacher(ctx, directory, vocab_size):
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = GPTArchConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                         num_query_groups=None, ffn_hidden_size=64, vocab_size=vocab_size,
                         padded_vocab_size=512, max_position_embeddings=64)
    with model_parallel():
        save_model_checkpoint(build_gpt_model(arch, seed=3), arch, directory)


@pytest.fixture(scope="module")
def text_run(pool, tokenizer_file, tmp_path_factory):
    """``(argv, eod id)`` of a colocated run on preprocessed text: short documents (one line
    each), so every 32-token sample holds several end-of-document tokens."""
    pytest.importorskip("tokenizers")
    from support.text import TEXT

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    tmp = tmp_path_factory.mktemp("documents")
    (tmp / "docs.txt").write_text(TEXT * 4, encoding="utf-8")
    tokenizer = HFTokenizer(tokenizer_file)
    prefix = str(tmp / "docs")
    preprocess([str(tmp / "docs.txt")], tokenizer, prefix, document_split="line")
    teacher = str(tmp / "teacher")
    pool.run(case_save_text_teacher, teacher, tokenizer.vocab_size)
    argv = [a for a in STUDENT if a != "--mock-data"] + [
        "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "100",
        "--data-path", prefix, "--tokenizer-model", tokenizer_file, "--split", "100,0,0",
        "--data-cache-path", str(tmp / "index_cache"), "--kd-teacher-load", teacher,
        "--kd-ce-weight", "0.5"]
    return argv, tokenizer.eod, prefix


def test_eod_mask_loss_and_reset_position_ids_reach_the_loss_and_both_models(pool, text_run):
    argv, eod, _ = text_run
    plain, seen_plain = pool.run(case_train_seeing_inputs, argv)[0]
    summary, seen = pool.run(case_train_seeing_inputs,
                             argv + ["--eod-mask-loss", "--reset-position-ids"])[0]
    eods = 0
    for tokens, mask in seen["masks"]:
        for row_tokens, row_mask in zip(tokens, mask, strict=True):
            assert row_mask == [0.0 if t == eod else 1.0 for t in row_tokens]
            eods += row_tokens.count(eod)
    assert eods >= 4  # the samples do hold documents' ends
    assert all(all(v == 1.0 for row in mask for v in row) for _, mask in seen_plain["masks"])
    roles = {role for role, _, _ in seen["forward"]}
    assert roles == {"student", "teacher"}
    resets = 0
    for role, tokens, positions in seen["forward"]:
        for row_tokens, row_positions in zip(tokens, positions, strict=True):
            # Megatron-LM's rule: the position after an end-of-document token is 0
            expected, p = [], 0
            for t in row_tokens:
                expected.append(p)
                p = 0 if t == eod else p + 1
            assert row_positions == expected, role
            resets += sum(1 for t in row_tokens[:-1] if t == eod)
    assert resets >= 4
    assert _losses(summary) != pytest.approx(_losses(plain), rel=1e-3)


def test_reset_position_ids_refused_where_the_teacher_takes_tokens_only(text_run, tmp_path):
    argv, _, _ = text_run
    served = [a for a in argv] + ["--reset-position-ids", "--kd-mode", "disaggregated",
                                  "--kd-teacher-endpoint", str(tmp_path)]
    with pytest.raises(ValueError, match="--reset-position-ids with --kd-mode disaggregated"):
        check_flags(served, 2)
    with pytest.raises(ValueError, match="--mock-data has none"):
        check_flags(STUDENT + ITERS + ["--kd-weight", "0", "--kd-ce-weight", "1",
                                       "--eod-mask-loss"], 2)


def test_weighted_data_path_blend_trains(pool, text_run):
    argv, _, prefix = text_run
    i = argv.index("--data-path")
    blended = argv[:i] + ["--data-path", "0.3", prefix, "0.7", prefix] + argv[i + 2:]
    summary = pool.run(case_train, blended)[0]
    assert summary["iterations"] == 2 and all(s["loss"] > 0 for s in summary["steps"])


# --- a long run: stopping in time, resuming ---------------------------------------------------

def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_exit_duration_saves_logs_a_resumable_exit_and_resumes_exactly(pool, teacher, tmp_path):
    argv = STUDENT + ["--train-iters", "5", "--eval-interval", "100", "--eval-iters", "0",
                      "--kd-teacher-load", teacher, "--hidden-dropout", "0.1"]
    straight = pool.run(case_train, argv)[0]
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    # 0.0001 minutes: past after the first step, whatever the machine
    first = pool.run(case_train, argv + ["--save", str(ckpt), "--load", str(ckpt),
                                         "--log-json", str(log),
                                         "--exit-duration-in-mins", "0.0001"])[0]
    assert first["iterations"] == 1 and first["exit_reason"] == "duration"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _records(log)[-1] == {"step": 1, "event": "exit", "reason": "duration",
                                 "resumable": True, "train_iters": 5}
    resumed = pool.run(case_train, argv + ["--load", str(ckpt)])[0]
    assert resumed["start_iteration"] == 1 and resumed["exit_reason"] is None
    assert _losses(first) + _losses(resumed) == _losses(straight)
    # --no-load-rng: the dropout masks are the seed's, not the checkpoint's: other losses from
    # the first resumed step; --no-load-optim: a fresh Adam state, the same first loss (the
    # weights and the data position are the checkpoint's), another second
    no_rng = pool.run(case_train, argv + ["--load", str(ckpt), "--no-load-rng"])[0]
    assert _losses(no_rng)[0] != _losses(resumed)[0]
    no_optim = pool.run(case_train, argv + ["--load", str(ckpt), "--no-load-optim"])[0]
    assert no_optim["start_iteration"] == 1
    assert _losses(no_optim)[0] == _losses(resumed)[0]
    assert _losses(no_optim)[1] != pytest.approx(_losses(resumed)[1], rel=1e-6)
    assert [s["lr"] for s in no_optim["steps"]] == [s["lr"] for s in resumed["steps"]]


# --- what it does not take ---------------------------------------------------------------------

def test_refused_flags_name_themselves(teacher):
    argv = STUDENT + ITERS + ["--kd-teacher-load", teacher]
    with pytest.raises(ValueError, match="--ckpt-format 'torch'.*pretrain_gpt.py"):
        check_flags(argv + ["--ckpt-format", "torch"], 2)
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine: Transformer "
                                         "Engine is not usable here"):
        check_flags(argv + ["--transformer-impl", "transformer_engine"], 2)
    assert check_flags(argv + ["--transformer-impl", "local", "--ckpt-format", "torch_dist"],
                       2).layout.dp == 2


def test_unknown_flags_are_named_with_the_pretrain_gpt_route(capsys):
    from megatron_kd.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", *STUDENT, *ITERS, "--async-save", "--use-flash-attn", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "does not take --async-save, --use-flash-attn, --no-such-flag" in err
    assert "--async-save: checkpoints are written synchronously" in err
    assert "--no-such-flag: not a flag of megatron-kd train" in err
    assert "pretrain_gpt.py" in err and "docs/megatron_lm_flags.md" in err


def test_the_docs_table_is_the_parser():
    """Every row of docs/megatron_lm_flags.md: "yes" flags are train's own, "no" flags are
    refused with the reason the table gives; every refused flag has its row."""
    import argparse

    from megatron_kd.commands.train import NOT_TAKEN, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = set(parser._option_string_actions)
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`[^|]*\| (yes|no) \|", (
        REPO / "docs" / "megatron_lm_flags.md").read_text(), flags=re.M)
    assert len(rows) >= 30
    table = dict(rows)
    for flag, taken in table.items():
        assert (flag in options) == (taken == "yes"), flag
        if taken == "no":
            assert flag in NOT_TAKEN, flag
    assert set(NOT_TAKEN) <= {f for f, t in table.items() if t == "no"}
