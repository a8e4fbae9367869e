"""Megatron-LM integration (megatron_kd.megatron_lm and patches/): cheapest first. One piece:
its tiers share one stand-in for Megatron-LM (``get_args``, its writers) and one pool's cases.

1. The patch: well formed and naming only entry points that exist (no Megatron-LM needed);
   applies cleanly to a Megatron-LM checkout at the pinned commit when ``MEGATRON_LM_DIR``
   points to one (skipped otherwise, with the reason).
2. The flags: ``with_kd_args`` adds exactly the ``--kd-*`` flags ``megatron-kd train`` accepts.
3. The patched entry points on megatron-core, on CPU, over 2 (and 4) gloo ranks:
   ``model_provider``, ``forward_step`` and ``loss_func`` against ``vocab_parallel_kd_loss``
   called directly (and a dense reference), through megatron-core's own pipeline schedule too
   (the last stage called without tokens, as Megatron-LM's ``get_batch`` does), and
   ``--kd-mode disaggregated`` against a real ``megatron-kd teacher serve`` replica (the losses
   of colocated training); ``--context-parallel-size 2`` (colocated, PP 2 x CP 2 with the last
   stage called without tokens, disaggregated) against CP 1; ``--kd-mode offline`` on a cache
   holding the run's rows in another order (TP 2 against the fused loss on the rows the test
   knows, CP 2, PP 2 without tokens on the last stage, caches without the run's samples
   refused); two colocated teachers (weights 1 3, TP 2 with sequence parallelism) against the
   two one-teacher runs, and the checks of several teachers.

Megatron-LM itself (``megatron.training``, ``pretrain_gpt.py``) is not installable here. The
stand-ins below replace only what megatron-core lacks, and play Megatron-LM's part as the
patched ``pretrain_gpt.py`` would call it:

* ``megatron.training.get_args`` -- a module put in ``sys.modules`` returning a namespace with
  the Megatron-LM arguments the integration reads;
* Megatron-LM's model provider (``partial(model_provider, gpt_builder)``) -- builds the student
  ``GPTModel`` with megatron_kd's builder;
* Megatron-LM's forward step -- reads a batch, cuts it for this context-parallel rank with
  Megatron-Core's ``get_batch_on_this_cp_rank`` and calls the model as ``pretrain_gpt.py`` does
  (``labels=`` and ``loss_mask=`` keywords, ``get_attr_wrapped_model(model, "vp_stage")``);
  its own loss function must never be called.
"""

import argparse
import contextlib
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from functools import partial

import pytest
import torch

from megatron_kd.megatron_lm import hooks as kd_lm
from megatron_kd.megatron_lm.checks import (
    CONFLICTING_FLAGS,
    LossChecks,
    check_megatron_args,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Same vocabulary (500 true, 512 padded) and maximum length as the teacher of support.train_cases.
STUDENT_ARCH = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": 500,
                "padded_vocab_size": 512, "max_position_embeddings": 64, "tie_embeddings": True}
SEQ, MBS = 32, 2


# --- 1. the patch ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,names", [
    ("model_provider", {"with_kd_args", "model_provider", "forward_step"}),
    ("model_builder", {"with_kd_args", "add_kd_hooks", "forward_step"})])
def test_patch_is_small_and_names_existing_entry_points(kind, names):
    with open(os.path.join(REPO, "patches", kd_lm.PATCHES[kind]), encoding="utf-8") as f:
        text = f.read()
    files = re.findall(r"^\+\+\+ b/(\S+)", text, flags=re.MULTILINE)
    assert files == ["pretrain_gpt.py"]
    added = [line[1:] for line in text.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in text.splitlines()
               if line.startswith("-") and not line.startswith("---")]
    assert len(added) <= 6 and len(removed) <= 3  # only the hunks: no copied Megatron-LM code
    assert set(re.findall(r"kd_lm\.(\w+)", "\n".join(added))) == names
    # the package's path, not the deprecated megatron_kd.integration.megatron_lm
    assert re.findall(r"^import (\S+) as kd_lm\b", "\n".join(added), flags=re.MULTILINE) == [
        "megatron_kd.megatron_lm"]
    for name in names:
        assert callable(getattr(kd_lm, name)), name
        assert getattr(importlib.import_module("megatron_kd.megatron_lm"), name) is getattr(
            kd_lm, name)
    with open(os.path.join(REPO, "patches", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for commit in (kd_lm.PINNED_MEGATRON_LM_COMMIT, kd_lm.MEGATRON_LM_MAIN_COMMIT,
                   kd_lm.MODEL_BUILDER_PATCH_FROM):
        assert commit in readme


def megatron_lm_checkouts():
    """The Megatron-LM checkouts named by ``MEGATRON_LM_DIR`` (``os.pathsep``-separated)."""
    return [d for d in os.environ.get("MEGATRON_LM_DIR", "").split(os.pathsep) if d]


def _git(root, *argv):
    return subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True,
                          check=False)


def patch_for_checkout(root):
    """``(kind, patch path)`` the patches README prescribes for the checkout at ``root``."""
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    if head == kd_lm.PINNED_MEGATRON_LM_COMMIT:
        kind = "model_provider"
    elif _git(root, "merge-base", "--is-ancestor", kd_lm.MODEL_BUILDER_PATCH_FROM,
              "HEAD").returncode == 0:
        kind = "model_builder"
    else:
        pytest.skip(f"{root} is at {head}: neither the pinned commit nor after "
                    f"{kd_lm.MODEL_BUILDER_PATCH_FROM[:10]}")
    return kind, os.path.join(REPO, "patches", kd_lm.PATCHES[kind])


def test_patch_applies_to_megatron_lm_checkouts():
    """On each checkout: its patch applies cleanly or is applied already (idempotent), and the
    other one does not apply."""
    roots = megatron_lm_checkouts()
    if not roots:
        pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM git checkouts, e.g. at "
                    f"{kd_lm.PINNED_MEGATRON_LM_COMMIT[:10]} and main)")
    for root in roots:
        assert os.path.isfile(os.path.join(root, "pretrain_gpt.py")), root
        kind, patch = patch_for_checkout(root)
        check = _git(root, "apply", "--check", patch)
        applied = _git(root, "apply", "--reverse", "--check", patch)
        assert check.returncode == 0 or applied.returncode == 0, (root, check.stderr)
        other = os.path.join(REPO, "patches",
                             next(p for k, p in kd_lm.PATCHES.items() if k != kind))
        assert _git(root, "apply", "--check", other).returncode != 0, (root, other)


# --- 2. the flags ---------------------------------------------------------------------------

def _kd_actions(parser):
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--kd-")}


def test_flags_match_megatron_kd_train():
    from megatron_kd.commands.train import add_arguments

    train_parser = argparse.ArgumentParser()
    add_arguments(train_parser)

    def modelopt_like(parser):  # stands in for ModelOpt's add_modelopt_args
        parser.add_argument("--export-kd-teacher-load")
        return parser

    lm_parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron-LM builds its parser
    kd_lm.with_kd_args(modelopt_like)(lm_parser)
    ours, theirs = _kd_actions(lm_parser), _kd_actions(train_parser)
    assert sorted(ours) == sorted(theirs) and len(ours) >= 14
    for opt, action in ours.items():
        other = theirs[opt]
        for attr in ("dest", "default", "type", "choices", "nargs"):
            assert getattr(action, attr) == getattr(other, attr), (opt, attr)
    argv = ["--kd-teacher-load", "/t", "--kd-loss", "jsd", "--kd-beta", "0.3",
            "--kd-teacher-dtype", "bf16", "--export-kd-teacher-load", "/x"]
    args = lm_parser.parse_args(argv)
    assert args.export_kd_teacher_load == "/x"
    plain = argparse.ArgumentParser(allow_abbrev=False)
    kd_lm.extra_args_provider(plain)
    assert sorted(_kd_actions(plain)) == sorted(theirs)


def _lm_args(kd_argv=(), **megatron_lm_fields):
    """What Megatron-LM's ``get_args()`` would hold: the parsed ``--kd-*`` flags plus the
    Megatron-LM fields the integration reads."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    kd_lm.extra_args_provider(parser)
    args = parser.parse_args(list(kd_argv))
    # Megatron-LM's defaults (--check-for-nan-in-loss-and-grad is on unless turned off); the
    # flags of CONFLICTING_FLAGS are absent, as in a tree or setup without them
    fields = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "padded_vocab_size": 512, "seq_length": SEQ, "sequence_parallel": False,
              "context_parallel_size": 1, "init_model_with_meta_device": False,
              "mtp_num_layers": None, "micro_batch_size": MBS, "vocab_size": None,
              "gradient_accumulation_fusion": False, "num_layers": STUDENT_ARCH["num_layers"],
              "virtual_pipeline_model_parallel_size": None,
              "check_for_nan_in_loss_and_grad": True, "check_for_spiky_loss": False}
    fields.update(megatron_lm_fields)
    for key, value in fields.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("argv, fields, message", [
    (["--kd-mode", "disaggregated", "--kd-teacher-load", "/t"], {},
     "--kd-mode disaggregated needs --kd-teacher-endpoint"),
    (["--kd-weight", "0", "--kd-ce-weight", "1"],
     {"sequence_parallel": True, "tensor_model_parallel_size": 3},
     ("--seq-length 32 is not divisible by --tensor-model-parallel-size 3 (--sequence-parallel) "
      "= 3: each sequence is split over those ranks")),
    # context parallelism: 2 x cp chunks of each sequence (x TP slices of those with SP)
    (["--kd-weight", "0", "--kd-ce-weight", "1"], {"context_parallel_size": 3},
     "--seq-length 32 is not divisible by 2 x --context-parallel-size 3 = 6"),
    (["--kd-weight", "0", "--kd-ce-weight", "1"],  # 36 splits in 2 x 2, not in 2 x 2 x 2
     {"context_parallel_size": 2, "seq_length": 36, "sequence_parallel": True,
      "tensor_model_parallel_size": 2},
     ("--seq-length 36 is not divisible by 2 x --context-parallel-size 2 x "
      "--tensor-model-parallel-size 2 (--sequence-parallel) = 8")),
    (["--kd-weight", "0", "--kd-ce-weight", "1"],
     {"context_parallel_size": 2, "hybrid_context_parallel": True},
     "--hybrid-context-parallel cannot be combined with --kd-*"),
    (["--kd-weight", "0", "--kd-ce-weight", "1"], {"context_parallel_size": 2, "sft": True},
     "--sft with --context-parallel-size 2 cannot be combined with --kd-*"),
    # Megatron-LM's own flags that conflict with --kd-* (each absent from some trees)
    (["--kd-teacher-load", "/t"], {"export_kd_teacher_load": "/modelopt_teacher"},
     ("--export-kd-teacher-load '/modelopt_teacher' cannot be combined with --kd-*: it turns on "
      "ModelOpt's own distillation")),
    (["--kd-teacher-load", "/t"], {"logits_load_dir": "/logits"},
     ("--logits-load-dir '/logits' cannot be combined with --kd-*: Megatron-LM's cached-logits "
      "loss hooks the output layer that --kd-* bypasses")),
    (["--kd-teacher-load", "/t"], {"logits_save_dir": "/logits"},
     ("--logits-save-dir '/logits' cannot be combined with --kd-*: its logits saver hooks the "
      "output layer")),
    (["--kd-teacher-load", "/t"], {"moe_use_upcycling": True},
     "--moe-use-upcycling cannot be combined with --kd-*: it builds the model twice"),
    (["--kd-teacher-load", "/nowhere"], {}, "'/nowhere' is not a directory"),
    ([], {}, "needs --kd-teacher-load"),
])
def test_unsupported_settings_refused(argv, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_megatron_args(_lm_args(argv, **fields))


def test_context_parallel_settings_pass():
    """Context parallelism with a sequence that splits (with sequence parallelism too), at
    Megatron-LM's defaults of its other context-parallel flags, is accepted."""
    for fields in ({"context_parallel_size": 2},
                   {"context_parallel_size": 4, "hybrid_context_parallel": False, "sft": False},
                   {"context_parallel_size": 2, "sequence_parallel": True,
                    "tensor_model_parallel_size": 2},
                   # Megatron-LM turns --sequence-parallel off at TP 1: 2 x 2 chunks of 36
                   {"context_parallel_size": 2, "seq_length": 36, "sequence_parallel": True}):
        kd, arch = check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"],
                                                **fields))
        assert arch is None and kd.loss.ce_weight == 1, fields
    # --sft without context parallelism and without a KD term: cross-entropy alone
    check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"], sft=True))


@pytest.mark.parametrize("attribute, flag", [
    ("reset_attention_mask", "--reset-attention-mask"),
    ("reset_position_ids", "--reset-position-ids"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ("sft", "--sft")])
def test_document_masking_refused_with_a_kd_term(attribute, flag):
    """Per-document masks, positions or packed sequences for the student while the teacher is
    given whole sequences: refused whenever the teacher is asked (here colocated at CP 1)."""
    with pytest.raises(ValueError, match=re.escape(f"{flag} cannot be combined with "
                                                   f"--kd-weight > 0")):
        check_megatron_args(_lm_args(["--kd-teacher-load", "/nowhere"], **{attribute: True}))


def test_context_parallel_gated_deltanet_teacher_refused(monkeypatch):
    """A colocated teacher with Gated DeltaNet layers runs in the student's context-parallel
    group, which its recurrence does not split: refused, pointing to a served teacher; the same
    teacher served (disaggregated) or at CP 1 is accepted."""
    import dataclasses

    from support.train_cases import TEACHER_ARCH

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.megatron_lm import checks

    arch = dataclasses.replace(GPTArchConfig(**TEACHER_ARCH), linear_attention_layers=[0],
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8)
    # the checkpoint's own checks (tensors against the architecture) are not this test's
    monkeypatch.setattr(checks, "check_teacher", lambda load, **kw: (load, arch))
    with pytest.raises(ValueError, match=re.escape(
            "--context-parallel-size 2 with a colocated Gated DeltaNet teacher (layers [0])")):
        check_megatron_args(_lm_args(["--kd-teacher-load", "/t"], context_parallel_size=2))
    check_megatron_args(_lm_args(["--kd-teacher-load", "/t"]))
    check_megatron_args(_lm_args(["--kd-teacher-load", "/t", "--kd-mode", "disaggregated",
                                  "--kd-teacher-endpoint", "/e"], context_parallel_size=2))


def test_conflicting_flags_unset_pass():
    """The conflicting flags at Megatron-LM's defaults (None, False) are not refused; a
    sequence-parallel layout is accepted (Megatron-LM has turned it off at TP 1 already)."""
    fields = {c.attribute: None for c in CONFLICTING_FLAGS} | {"moe_use_upcycling": False}
    kd, arch = check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"],
                                            sequence_parallel=True, tensor_model_parallel_size=2,
                                            **fields))
    assert arch is None and kd.loss.ce_weight == 1


# --- Megatron-LM's checks of the loss: the rerun state machine -----------------------------

@pytest.fixture
def rerun_machine():
    """Megatron-Core's rerun state machine as Megatron-LM starts it without re-runs
    (``--rerun-mode disabled``): a fatal rejected result raises, another is logged."""
    from megatron.core import rerun_state_machine as rsm

    from megatron_kd.integration.cpu_shim import install_cpu_shim

    install_cpu_shim()  # its messages name torch.cuda.current_device()
    rsm.destroy_rerun_state_machine()  # a machine an earlier test started implicitly
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    yield rsm.get_rerun_state_machine()
    rsm.destroy_rerun_state_machine()


def _fixed_loss(value):
    """A stand-in for ``vocab_parallel_kd_loss`` whose summed loss is ``value``."""
    def loss_fn(student_hidden, student_weight, *, terms_out, loss_mask, **kwargs):
        loss = student_hidden.sum() * 0 + value
        terms_out.update(kd_sum=loss.detach(), ce_sum=loss.detach())
        return loss, loss_mask.sum().to(torch.int64)
    return loss_fn


def _call_loss_func(value, checks):
    kd, _ = check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"]))
    hidden = torch.zeros(1, 3, 4, requires_grad=True)
    return kd_lm.loss_func(torch.ones(1, 3), hidden, labels=torch.zeros(1, 3, dtype=torch.long),
                           student_weight=torch.zeros(8, 4), teacher=None,
                           config=kd.loss_config(vocab_size=8),
                           loss_fn=_fixed_loss(value), checks=checks)


@pytest.mark.parametrize("value, message", [
    (float("nan"), "found NaN in local forward loss calculation"),
    (float("inf"), "found Inf in local forward loss calculation")])
def test_non_finite_loss_reaches_rerun_state_machine(rerun_machine, value, message):
    """``--check-for-nan-in-loss-and-grad`` (Megatron-LM's default): a NaN or inf loss is
    handed to the rerun state machine with Megatron-LM's own message, fatal; without the flag
    the loss goes through unchecked, as in Megatron-LM."""
    with pytest.raises(RuntimeError, match=re.escape(f"(message='{message}')")):
        _call_loss_func(value, LossChecks(nan=True))
    loss, _, _ = _call_loss_func(value, LossChecks(nan=False))
    assert not torch.isfinite(loss)


def test_spiky_loss_check(rerun_machine, caplog):
    """``--check-for-spiky-loss``: every loss goes to the machine's ``is_unexpectedly_large``
    (threshold 10 x the largest of the first 100, context ``loss``); a spike past it is
    reported, not fatal, with Megatron-LM's message. Off: the machine never sees a loss."""
    for _ in range(100):
        _call_loss_func(2.0, LossChecks(spiky=False))
    assert "loss" not in rerun_machine.large_value_counts
    for _ in range(100):  # the machine's sample of the usual loss
        _call_loss_func(2.0, LossChecks(spiky=True))
    assert rerun_machine.max_values["loss"] == 2.0
    with caplog.at_level("WARNING", logger="megatron.core.rerun_state_machine"):
        _call_loss_func(19.0, LossChecks(spiky=True))  # under 10 x 2: not spiky
        assert "Spiky loss" not in caplog.text
        loss, _, _ = _call_loss_func(21.0, LossChecks(spiky=True))
    assert loss.item() == 21.0
    assert "Unexpected result" in caplog.text and "(message='Spiky loss')" in caplog.text


def test_loss_checks_follow_megatron_lm_flags():
    """What Megatron-LM's flags ask for is what the forward step's loss function checks."""
    assert LossChecks.from_args(_lm_args()) == LossChecks(nan=True, spiky=False)
    assert LossChecks.from_args(_lm_args(check_for_nan_in_loss_and_grad=False,
                                         check_for_spiky_loss=True)) == \
        LossChecks(nan=False, spiky=True)


def test_forward_step_needs_labels_and_loss_mask():
    """A forward step that calls the model without labels= / loss_mask= is refused (the loss
    would have nothing to compare with), not silently trained without them."""

    class Student(torch.nn.Module):
        def forward(self, tokens, position_ids, attention_mask, **kwargs):
            return torch.zeros(*tokens.shape, 4)

    student = Student()
    kd, _ = check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"]))
    # what model_provider attaches to the last stage
    student.kd_state = kd_lm.KDState(kd=kd, config=kd.loss_config(vocab_size=4), tp_group=None)
    batch = {"tokens": torch.zeros(1, 3, dtype=torch.long),
             "position_ids": torch.zeros(1, 3, dtype=torch.long)}

    def without_labels(data_iterator, model):
        b = next(data_iterator)
        return model(b["tokens"], b["position_ids"], None), None

    with pytest.raises(ValueError, match="labels= and loss_mask="):
        kd_lm.forward_step(without_labels, iter([batch]), student)
    with pytest.raises(ValueError, match="schedule plans are not supported"):
        kd_lm.forward_step(without_labels, iter([batch]), student, return_schedule_plan=True)


# --- 3. the entry points on 2 gloo ranks ------------------------------------------------------
# Stand-ins for Megatron-LM (see the module docstring).

@contextlib.contextmanager
def megatron_lm_stub(args, tensorboard_writer=None):
    """``megatron.training.get_args`` returning ``args`` (Megatron-LM is not installed) and
    ``megatron.training.global_vars``' writer getters returning ``tensorboard_writer`` (a real
    ``SummaryWriter``, or None as on Megatron-LM's ranks but the last) and no W&B writer."""
    stub = types.ModuleType("megatron.training")
    stub.get_args = lambda: args
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer = lambda: tensorboard_writer
    global_vars.get_wandb_writer = lambda: None
    stub.global_vars = global_vars
    names = ("megatron.training", "megatron.training.global_vars")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(zip(names, (stub, global_vars)))
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def megatron_lm_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                               pg_collection=None):
    """Megatron-LM's ``partial(model_provider, gpt_builder)``: the student, this stage (and
    virtual stage), its depth and layout from Megatron-LM's arguments as ``gpt_builder`` reads
    them; seeded once per pipeline rank, before its first chunk, as Megatron-LM seeds."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.gpt import build_gpt_model

    args = get_args()
    layout = {"sequence_parallel": args.sequence_parallel}
    if args.virtual_pipeline_model_parallel_size:
        layout["virtual_pipeline_model_parallel_size"] = args.virtual_pipeline_model_parallel_size
    first_chunk = vp_stage in (None, 0)
    return build_gpt_model(
        GPTArchConfig(**dict(STUDENT_ARCH, num_layers=args.num_layers)), pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage,
        seed=1234 + 100 * ps.get_pipeline_model_parallel_rank() if first_chunk else None,
        **layout)


def megatron_lm_loss_func(loss_mask, output_tensor, model=None):
    raise AssertionError("Megatron-LM's own loss function must not be used when distilling")


def megatron_lm_forward_step(data_iterator, model, drop_inputs_off_first_stage=False):
    """Megatron-LM's forward step: a batch, then the model with labels and loss_mask. With
    ``drop_inputs_off_first_stage`` it calls the model as Megatron-LM's ``get_batch`` leaves it
    on later pipeline stages: ``tokens`` and ``position_ids`` None."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")  # as pretrain_gpt.py (via .module)
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if not first and not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
        # Megatron-LM's get_batch reads nothing there (that chunk has no data iterator)
        return model(None, None, None, labels=None, loss_mask=None), None
    batch = next(data_iterator)
    if drop_inputs_off_first_stage and not first:
        batch["tokens"] = batch["position_ids"] = None  # rewrites the item, as get_batch does
    batch = on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(megatron_lm_loss_func, batch["loss_mask"], model=model)


def on_this_cp_rank(batch):
    """``batch`` cut to this context-parallel rank's chunks by Megatron-Core's own
    ``get_batch_on_this_cp_rank`` (what Megatron-LM's ``get_batch`` calls; in place, as there;
    its signature grew a hybrid-CP switch after 0.16)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    kw = ({"is_hybrid_cp": False}
          if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {})
    return get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group(), **kw)


def make_batch(seed):
    """A ``[b, s]`` batch in Megatron-LM's layout, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, STUDENT_ARCH["vocab_size"], (MBS, SEQ + 1), generator=g)
    loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()}


def _reference_teacher(teacher_dir):
    """The teacher built and loaded independently of megatron_lm.model_provider."""
    from megatron_kd.integration.checkpoint import (
        load_model_checkpoint,
        read_checkpoint_arch,
    )
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.output_layer import bypass_output_layer

    teacher = build_gpt_model(read_checkpoint_arch(teacher_dir), seed=None,
                              perform_initialization=False)
    load_model_checkpoint(teacher, teacher_dir)
    bypass_output_layer(teacher).eval()
    return teacher


def case_forward_and_loss(ctx, teacher_dir, kd_argv, literal):
    """TP=2: the patched forward step + loss function vs the fused loss called directly, and
    vs the dense reference on ``literal`` (the loss the test means, not the parsed flags)."""
    from megatron.core import parallel_state as ps
    from support.train_cases import literal_dense_kd_loss

    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import output_layer_weight, to_sbh
    from megatron_kd.loss import DenseTeacher, vocab_parallel_kd_loss
    from megatron_kd.modes.args import KDArgs

    args = _lm_args(["--kd-teacher-load", teacher_dir, *kd_argv], tensor_model_parallel_size=2)
    out = {}
    with megatron_lm_stub(args), model_parallel(tp=2), device_context():
        model = kd_lm.model_provider(megatron_lm_model_provider, pre_process=True,
                                     post_process=True)
        state = kd_lm.kd_state(model)
        student_params = {id(p) for p in model.parameters()}
        out["teacher_frozen"] = not any(p.requires_grad for p in state.teacher.parameters())
        out["teacher_outside_student"] = not any(
            id(p) in student_params for p in state.teacher.parameters()) and not any(
            "teacher" in k for k in model.state_dict())
        batch = make_batch(seed=7)
        output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step, iter([batch]), model)
        out["output_shape"] = tuple(output.shape)
        loss, num_tokens, report = loss_fn(output)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        out["loss"], out["num_tokens"] = loss.item(), num_tokens
        out["report"] = {k: v.tolist() for k, v in report.items()}

        # the same loss, called directly on independently computed hidden states
        teacher = _reference_teacher(teacher_dir)
        tokens, pos = batch["tokens"], batch["position_ids"]
        student_hidden = to_sbh(model(tokens, pos, None))
        with torch.no_grad():
            teacher_hidden = to_sbh(teacher(tokens, pos, None))
        config = KDArgs.from_args(args).loss_config(vocab_size=STUDENT_ARCH["vocab_size"])
        kw = {"labels": batch["labels"].t(), "loss_mask": batch["loss_mask"].t(),
              "config": config, "tp_group": ps.get_tensor_model_parallel_group()}
        teacher_record = DenseTeacher(hidden=teacher_hidden, weight=output_layer_weight(teacher))
        ref, ref_tokens = vocab_parallel_kd_loss(student_hidden, output_layer_weight(model),
                                                 teacher_record, **kw)
        ref.backward()
        out["ref"], out["ref_tokens"] = ref.item(), ref_tokens.item()
        out["grad_max_diff"] = max(float((grads[n] - p.grad).abs().max())
                                   for n, p in model.named_parameters())
        dense, _ = literal_dense_kd_loss(literal)(
            student_hidden.detach(), output_layer_weight(model).detach(),
            teacher_record, terms_out={}, **kw)
        out["dense"] = dense.item()

        # evaluation reports the teacher's own LM loss too
        model.eval()
        with torch.no_grad():
            output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step, iter([batch]), model)
            out["eval_keys"] = sorted(loss_fn(output)[2])
    return out


def cp_summed_reports(reports):
    """Loss reports (``{name: [sum, tokens]}`` tensors) summed over the context-parallel group
    as Megatron-LM's ``train_step`` sums them (over data x context parallelism): the whole
    sequences' sums and counts, as at context-parallel size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    summed = []
    for report in reports:
        summed.append({})
        for key, pair in report.items():
            pair = pair.detach().clone()
            if group.size() > 1:
                dist.all_reduce(pair, group=group)
            summed[-1][key] = pair.tolist()
    return summed


def cp_summed_grads(model):
    """``{name: gradient}`` summed over the context-parallel group, as Megatron-LM's
    ``finalize_model_grads`` sums them: the gradients of the whole sequences' loss sums."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            if group.size() > 1:
                dist.all_reduce(grads[name], group=group)
    return grads


def _teacher_argv(teacher_dir):
    """``--kd-teacher-load teacher_dir`` (None: no teacher flag, as offline)."""
    return ["--kd-teacher-load", teacher_dir] if teacher_dir is not None else []


def stage_weights(chunks):
    """The student weights this rank's model chunks hold, by their place in a PP 1 model:
    ``{"layers": {layer: state}}`` (global layer numbers), and where held ``"embedding"``,
    ``"final_norm"`` (states) and ``"output"`` (the output layer's weight)."""
    from megatron_kd.integration.output_layer import output_layer_weight

    def copy(module):
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in module.state_dict().items()}  # (extra states are None on CPU)

    parts = {"layers": {}}
    for chunk in chunks:
        if chunk.pre_process:
            parts["embedding"] = copy(chunk.embedding)
        for layer in chunk.decoder.layers:
            parts["layers"][layer.layer_number - 1] = copy(layer)
        if chunk.post_process:
            parts["final_norm"] = copy(chunk.decoder.final_layernorm)
            parts["output"] = output_layer_weight(chunk).detach().clone()
    return parts


def merged_weights(ranks):
    """:func:`stage_weights` of every pipeline rank, as one PP 1 model's."""
    merged = {"layers": {}}
    for parts in ranks:
        merged["layers"].update(parts["layers"])
        merged.update({k: v for k, v in parts.items() if k != "layers"})
    assert sorted(merged["layers"]) == list(range(len(merged["layers"]))), merged["layers"].keys()
    return merged


def case_pp1_direct_losses(ctx, teacher_dir, weights, seeds, loss_kw):
    """The student at PP 1 with ``weights`` (:func:`merged_weights`), and the fused loss called
    directly on it, configured by ``loss_kw`` (literal ``KDLossConfig`` fields, not the parsed
    flags), for the batch of each of ``seeds``: ``[{name: [sum, tokens]}]`` as the loss
    reports name them."""
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import (
        bypass_output_layer,
        output_layer_weight,
        to_sbh,
    )
    from megatron_kd.loss import DenseTeacher, KDLossConfig, vocab_parallel_kd_loss

    config = KDLossConfig(vocab_size=STUDENT_ARCH["vocab_size"], **loss_kw)
    with model_parallel(tp=1), device_context():
        arch = GPTArchConfig(**dict(STUDENT_ARCH, num_layers=len(weights["layers"])))
        student = build_gpt_model(arch, seed=None, perform_initialization=False)
        student.embedding.load_state_dict(weights["embedding"])
        for i, layer in enumerate(student.decoder.layers):
            layer.load_state_dict(weights["layers"][i])
        student.decoder.final_layernorm.load_state_dict(weights["final_norm"])
        bypass_output_layer(student)
        # tied embeddings: at PP 2 the last stage's copy of the output layer is the first's
        assert torch.equal(output_layer_weight(student), weights["output"])
        teacher = _reference_teacher(teacher_dir)
        losses = []
        for seed in seeds:
            batch = make_batch(seed)
            tokens, pos = batch["tokens"], batch["position_ids"]
            with torch.no_grad():
                teacher_hidden = to_sbh(teacher(tokens, pos, None))
            terms = {}
            loss, num_tokens = vocab_parallel_kd_loss(
                to_sbh(student(tokens, pos, None)), output_layer_weight(student),
                DenseTeacher(hidden=teacher_hidden, weight=output_layer_weight(teacher)),
                labels=batch["labels"].t(),
                loss_mask=batch["loss_mask"].t(), config=config, terms_out=terms)
            n = float(num_tokens)
            losses.append({"total loss": [float(loss), n], "kd loss": [float(terms["kd_sum"]), n],
                           "lm loss": [float(terms["ce_sum"]), n]})
    return losses


def _assert_losses_close(reports, direct):
    """A pipeline's last-stage loss reports against the PP 1 direct losses: the same fp32
    operations on the same weights and batches but for where the stages' activations were
    handed over, measured equal here; 1e-5 relative leaves other BLAS builds room while a
    wrong batch, teacher or loss setting moves them by far more."""
    assert len(reports) == len(direct)
    for got, want in zip(reports, direct, strict=True):
        assert set(got) == set(want)
        for name, (value, tokens) in want.items():
            assert got[name][1] == tokens, name
            assert got[name][0] == pytest.approx(value, rel=1e-5), name


def case_pipeline_schedule(ctx, teacher_dir, kd_argv, drop_inputs=False, tp=1,
                           sequence_parallel=False, cp=1, per_token_loss=False, weights=False):
    """PP=2 (x ``tp`` x ``cp``) through megatron-core's schedule: the teacher only on the last
    stage, gradients reaching the first. ``drop_inputs``: the last stage's model is called
    without tokens. Reports and gradients summed over the context-parallel ranks
    (:func:`cp_summed_reports`, :func:`cp_summed_grads`). ``per_token_loss``: the schedule
    leaves the loss sums undivided (Megatron-LM's ``--calculate-per-token-loss``; otherwise it
    divides each by this rank's token count and the microbatches). ``weights``: also the
    stage's :func:`stage_weights`."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel

    args = _lm_args([*_teacher_argv(teacher_dir), *kd_argv],
                    pipeline_model_parallel_size=2, tensor_model_parallel_size=tp,
                    sequence_parallel=sequence_parallel, context_parallel_size=cp)
    with megatron_lm_stub(args), model_parallel(tp=tp, pp=2, cp=cp), device_context():
        from megatron.core.process_groups_config import ProcessGroupCollection

        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        # as Megatron-LM's get_model calls the provider: with its process-group collection
        model = kd_lm.model_provider(megatron_lm_model_provider, pre_process=first,
                                     post_process=last, config=None,
                                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        model.config.calculate_per_token_loss = per_token_loss
        reports = get_forward_backward_func()(
            forward_step_func=partial(kd_lm.forward_step, partial(
                megatron_lm_forward_step, drop_inputs_off_first_stage=drop_inputs)),
            data_iterator=iter([make_batch(seed=11), make_batch(seed=12)]), model=[model],
            num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        reports, grads = cp_summed_reports(reports), cp_summed_grads(model)
        return {"last": last, "state": kd_lm.kd_state(model) is not None,
                "pending": dict(kd_lm._pending_teacher), "reports": reports, "grads": grads,
                "grad_norm": sum(float(g.norm()) for g in grads.values()),
                "weights": stage_weights([model]) if weights else None}


def case_train_microbatches(ctx, teacher_dir, kd_argv, n=3, tensorboard_dir=None, tp=2, cp=1,
                            sequence_parallel=False):
    """TP ``tp`` x CP ``cp``: ``n`` training microbatches through the patched forward step and
    loss function (one data iterator, as Megatron-LM's), then one evaluation microbatch;
    per-microbatch loss reports and the summed gradients, both summed over the
    context-parallel ranks (:func:`cp_summed_reports`, :func:`cp_summed_grads`).
    ``tensorboard_dir``: the last rank has Megatron-LM's TensorBoard writer, writing there."""
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel

    args = _lm_args([*_teacher_argv(teacher_dir), *kd_argv], tensor_model_parallel_size=tp,
                    context_parallel_size=cp, sequence_parallel=sequence_parallel)
    writer = None
    if tensorboard_dir is not None and ctx.rank == ctx.world_size - 1:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=tensorboard_dir)
    with megatron_lm_stub(args, writer), model_parallel(tp=tp, cp=cp), device_context():
        model = kd_lm.model_provider(megatron_lm_model_provider, pre_process=True,
                                     post_process=True)
        state = kd_lm.kd_state(model)
        data = iter([make_batch(seed=20 + i) for i in range(n)])
        reports = []
        try:
            for _ in range(n):
                output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step, data, model)
                loss, _, report = loss_fn(output)
                loss.backward()
                reports.append(report)
            reports, grads = cp_summed_reports(reports), cp_summed_grads(model)
            grad_norm = sum(float(g.norm()) for g in grads.values())
            model.eval()
            with torch.no_grad():
                output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step,
                                                     iter([make_batch(seed=99)]), model)
                eval_report = cp_summed_reports([loss_fn(output)[2]])[0]
        finally:
            if state.client is not None:
                state.client.close()
            if writer is not None:
                writer.close()
        return {"reports": reports, "grad_norm": grad_norm, "grads": grads, "eval": eval_report,
                "teacher_built": state.teacher is not None,
                "client": state.client is not None}


@contextlib.contextmanager
def microbatch_calculator(microbatches):
    """Megatron-LM's microbatch calculator set to ``microbatches`` a step (data-parallel 1)."""
    from megatron.core import num_microbatches_calculator as calculator

    calculator.init_num_microbatches_calculator(
        rank=0, rampup_batch_size=None, global_batch_size=MBS * microbatches,
        micro_batch_size=MBS, data_parallel_size=1)
    try:
        yield
    finally:
        calculator.unset_num_microbatches_calculator()


def case_interleaved_schedule(ctx, teacher_dir, kd_argv, drop_inputs, steps=2, microbatches=2):
    """PP 2 with two virtual stages per rank (4 layers) through megatron-core's interleaved
    schedule, built and fed as Megatron-LM builds and feeds them: ``get_model``'s provider calls
    (``vp_stage`` 0 then 1) and one data iterator per chunk, kept over the steps, where
    Megatron-LM builds one (the first stage's first chunk, the last stage's last chunk; the
    other chunks read nothing); ``steps`` steps of ``microbatches`` (Megatron-LM's microbatch
    calculator). The last rank records the microbatches its teacher source is asked for, with
    the tokens the teacher is called on."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel

    args = _lm_args(["--kd-teacher-load", teacher_dir, *kd_argv], pipeline_model_parallel_size=2,
                    num_layers=4, virtual_pipeline_model_parallel_size=2)
    with megatron_lm_stub(args), model_parallel(pp=2, vp=2), device_context(), \
            microbatch_calculator(microbatches):
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        chunks = []
        for vp in range(2):
            chunk = kd_lm.model_provider(
                megatron_lm_model_provider, vp_stage=vp, config=None, pg_collection=pgc,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp))
            chunk.vp_stage = vp  # as Megatron-LM's get_model marks each chunk
            chunks.append(chunk)
        # Megatron-LM's interleaved default (--overlap-p2p-communication): no batched p2p
        chunks[0].config.batch_p2p_comm = False
        states = [kd_lm.kd_state(c) for c in chunks]
        asked = []
        if states[-1] is not None:
            source = states[-1].source
            inputs = source.inputs

            def recording(mb, *, training):
                asked.append((mb.step, mb.index, mb.model_call()[0][0].clone()))
                return inputs(mb, training=training)

            source.inputs = recording
        batches = [make_batch(seed=60 + i) for i in range(steps * microbatches)]
        data = [iter(batches) if ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)
                else None,
                iter(batches) if ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
                else None]
        step = partial(kd_lm.forward_step, partial(megatron_lm_forward_step,
                                                   drop_inputs_off_first_stage=drop_inputs))
        reports = []
        for _ in range(steps):
            reports += get_forward_backward_func()(
                forward_step_func=step, data_iterator=data, model=chunks,
                num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MBS,
                forward_only=False)
        return {"last_rank": ps.is_pipeline_last_stage(ignore_virtual=True),
                "has_state": [s is not None for s in states],
                "has_teacher": [s is not None and s.teacher is not None for s in states],
                "pending": dict(kd_lm._pending_teacher),
                "asked": [(st, index) for st, index, _ in asked],
                "teacher_tokens_in_order": all(
                    torch.equal(tokens, batch["tokens"])
                    for (_, _, tokens), batch in zip(asked, batches)) and
                len(asked) == len(batches),
                "reports": [{k: v.tolist() for k, v in r.items()} for r in reports],
                "grad_norm": sum(float(p.grad.norm()) for c in chunks for p in c.parameters()
                                 if p.grad is not None),
                "weights": stage_weights(chunks)}


def case_sequence_parallel(ctx, teacher_dir, sequence_parallel, n=2):
    """TP 2, with or without ``--sequence-parallel``, through the patched entry points: ``n``
    training microbatches, then one evaluation microbatch. Returns each rank's loss reports
    and gradients, those of sequence-parallel weights summed over the TP group as Megatron-LM's
    ``finalize_model_grads`` sums them (``_allreduce_non_tensor_model_parallel_grads``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel

    args = _lm_args(["--kd-teacher-load", teacher_dir, "--kd-ce-weight", "0.3"],
                    tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    with megatron_lm_stub(args), model_parallel(tp=2), device_context():
        model = kd_lm.model_provider(megatron_lm_model_provider)
        state = kd_lm.kd_state(model)
        data = iter([make_batch(seed=40 + i) for i in range(n)])
        reports, shapes = [], set()
        for _ in range(n):
            output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step, data, model)
            shapes.add(tuple(output.shape))
            loss, _, report = loss_fn(output)
            loss.backward()
            reports.append({k: v.tolist() for k, v in report.items()})
        marked = sorted(name for name, p in model.named_parameters()
                        if getattr(p, "sequence_parallel", False))
        for name, p in model.named_parameters():
            if name in marked:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        model.eval()
        with torch.no_grad():
            output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step,
                                                 iter([make_batch(seed=99)]), model)
            evaluation = {k: v.tolist() for k, v in loss_fn(output)[2].items()}
        return {"shapes": shapes, "marked": marked, "reports": reports, "eval": evaluation,
                "loss_config_sp": state.config.sequence_parallel,
                "teacher_sp": state.teacher.config.sequence_parallel,
                "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def case_provider_error(ctx, teacher_dir, **fields):
    from megatron_kd.integration.groups import model_parallel

    args = _lm_args(["--kd-teacher-load", teacher_dir], **fields)
    with megatron_lm_stub(args), model_parallel(tp=2):
        try:
            kd_lm.model_provider(megatron_lm_model_provider)
        except ValueError as e:
            return str(e)
    return None


@pytest.fixture(scope="module")
def teacher_dir(teacher):
    return teacher  # the tier's tiny teacher (tests/e2e/conftest.py)


# Each case's flags and, written out apart from them, the loss they mean (defaults included:
# beta 0.5, kd weight 1, ce weight 0, temperature 1).
@pytest.mark.parametrize("kd_argv, meant", [
    (["--kd-loss", "forward_kl", "--kd-temperature", "2", "--kd-ce-weight", "0.5"],
     {"kind": "forward_kl", "temperature": 2.0, "beta": 0.5, "kd_weight": 1.0, "ce_weight": 0.5}),
    (["--kd-loss", "jsd", "--kd-beta", "0.3", "--kd-weight", "0.7"],
     {"kind": "jsd", "temperature": 1.0, "beta": 0.3, "kd_weight": 0.7, "ce_weight": 0.0}),
])
def test_forward_step_and_loss_match_fused_loss(pool, teacher_dir, kd_argv, meant):
    from megatron_kd.modes.args import KDArgs

    # the flags, as Megatron-LM parses them with the hook's extra_args_provider, are that loss
    parsed = KDArgs.from_args(_lm_args(["--kd-teacher-load", teacher_dir, *kd_argv])).loss
    assert {key: getattr(parsed, key) for key in meant} == meant
    # the dense reference's values: these literals, never the parsed flags (the true
    # vocabulary of STUDENT_ARCH; no label is -100 in make_batch's)
    literal = {**meant, "vocab_size": 500, "ignore_index": -100}
    assert STUDENT_ARCH["vocab_size"] == literal["vocab_size"]
    for r in pool.run(case_forward_and_loss, teacher_dir, kd_argv, literal):
        assert r["teacher_frozen"] and r["teacher_outside_student"]
        assert r["output_shape"] == (MBS, SEQ, STUDENT_ARCH["hidden_size"])  # hidden, not logits
        # The same fp32 operations in the same order as the direct call: identical.
        assert r["loss"] == r["ref"]
        assert r["grad_max_diff"] == 0.0
        # Against the dense textbook loss: only the summation order differs (windowed online
        # softmax vs one log_softmax); fp32 over 64 tokens, measured <= 1e-6 relative.
        assert r["loss"] == pytest.approx(r["dense"], rel=1e-5)
        assert int(r["num_tokens"]) == r["ref_tokens"]
        rep = r["report"]
        assert set(rep) == {"total loss", "kd loss", "lm loss"}
        assert rep["total loss"] == pytest.approx([r["loss"], r["ref_tokens"]], rel=1e-6)
        assert rep["total loss"][0] == pytest.approx(
            meant["kd_weight"] * rep["kd loss"][0] + meant["ce_weight"] * rep["lm loss"][0],
            rel=1e-5)
        assert r["eval_keys"] == ["kd loss", "lm loss", "teacher lm loss", "total loss"]


def test_pipeline_schedule(pool, teacher_dir):
    first, last = pool.run(case_pipeline_schedule, teacher_dir, ["--kd-ce-weight", "0.2"],
                           weights=True)
    assert not first["last"] and last["last"]
    assert not first["state"] and last["state"]
    assert first["pending"] == {} and last["pending"] == {}  # no teacher left behind
    assert first["reports"] == [] and len(last["reports"]) == 2
    assert first["grad_norm"] > 0 and last["grad_norm"] > 0  # backward crossed the stages
    # the last stage's losses: those of the fused loss called directly on the student at PP 1
    # with the stages' weights, on the same batches (the schedule's seeds 11 and 12)
    direct = pool.run(case_pp1_direct_losses, teacher_dir,
                      merged_weights([first["weights"], last["weights"]]), [11, 12],
                      {"ce_weight": 0.2})[0]
    _assert_losses_close(last["reports"], direct)


def test_virtual_pipeline_stages(pool, teacher_dir):
    """Interleaved (2 virtual stages a rank) as Megatron-LM builds and runs it: the teacher
    (built at virtual stage 0) ends up on the last rank's last chunk only; it is asked for the
    microbatches of that chunk's data iterator in the schedule's order, numbered step by step
    with Megatron-LM's microbatches a step (what a disaggregated teacher's requests are keyed
    by), on the tokens of the same microbatch even though Megatron-LM calls that chunk without
    them. The losses are those of the student at PP 1 with the chunks' weights, the fused loss
    called directly with the flags' values written out."""
    argv = ["--kd-loss", "reverse_kl", "--kd-temperature", "2", "--kd-ce-weight", "0.2"]
    first, last = pool.run(case_interleaved_schedule, teacher_dir, argv, True)
    assert not first["last_rank"] and first["has_state"] == [False, False]
    assert last["last_rank"] and last["has_teacher"] == [False, True]
    assert first["pending"] == {} and last["pending"] == {}
    assert first["asked"] == [] and last["asked"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert last["teacher_tokens_in_order"]
    assert first["reports"] == [] and len(last["reports"]) == 4
    assert first["grad_norm"] > 0 and last["grad_norm"] > 0
    direct = pool.run(case_pp1_direct_losses, teacher_dir,
                      merged_weights([first["weights"], last["weights"]]), [60, 61, 62, 63],
                      {"kind": "reverse_kl", "temperature": 2.0, "ce_weight": 0.2})[0]
    _assert_losses_close(last["reports"], direct)
    # the same schedule with the tokens handed to the last chunk: the same losses, exactly
    with_tokens = pool.run(case_interleaved_schedule, teacher_dir, argv, False)[1]
    assert with_tokens["reports"] == last["reports"]
    assert with_tokens["grad_norm"] == last["grad_norm"]


def test_sequence_parallel_matches_tensor_parallel(pool, teacher_dir):
    """``--sequence-parallel`` at TP 2 through the patched entry points: the student hands the
    loss its ``[b, s/2, h]`` slice, the teacher is built sequence-parallel, and the losses
    (training and evaluation) and every gradient are those of TP 2 without it."""
    plain = pool.run(case_sequence_parallel, teacher_dir, False)
    sp = pool.run(case_sequence_parallel, teacher_dir, True)
    h = STUDENT_ARCH["hidden_size"]
    for p, q in zip(plain, sp):
        assert p["shapes"] == {(MBS, SEQ, h)} and q["shapes"] == {(MBS, SEQ // 2, h)}
        assert (p["loss_config_sp"], p["teacher_sp"]) == (False, False)
        assert (q["loss_config_sp"], q["teacher_sp"]) == (True, True)
        assert p["marked"] == [] and q["marked"]  # the norms' weights, as TE marks its own
        assert set(q["eval"]) == {"total loss", "kd loss", "lm loss", "teacher lm loss"}
        # Two-rank sums are the same in either order (reduce-scatter or all-reduce): the
        # losses are identical. The norms' weight gradients are summed over two halves of the
        # sequence, then over the ranks: fp32 rounding, measured <= 1.5e-8 absolute.
        assert q["reports"] == p["reports"] and q["eval"] == p["eval"]
        assert p["grads"].keys() == q["grads"].keys()
        for name, grad in p["grads"].items():
            torch.testing.assert_close(q["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def pool4(dist_pool_factory):
    return dist_pool_factory(4)


def test_sequence_parallel_last_stage_without_tokens(pool4, teacher_dir):
    """PP 2 x TP 2 with ``--sequence-parallel``: Megatron-LM calls the last stage without
    tokens; its sequence-parallel teacher still gets the whole sequence (TP rank 0's item,
    broadcast over the TP group), so the losses are those of a last stage called with them."""
    argv = ["--kd-ce-weight", "0.2"]
    without = pool4.run(case_pipeline_schedule, teacher_dir, argv, True, 2, True)
    with_tokens = pool4.run(case_pipeline_schedule, teacher_dir, argv, False, 2, True)
    for w, t in zip(without, with_tokens):
        assert w["reports"] == t["reports"] and w["grad_norm"] == t["grad_norm"]
    assert [r["last"] for r in without] == [False, False, True, True]
    for r in without[2:]:
        assert len(r["reports"]) == 2 and all(rep["kd loss"][0] > 0 for rep in r["reports"])


def test_vocabulary_mismatch_refused(pool, teacher_dir):
    for msg in pool.run(case_provider_error, teacher_dir, padded_vocab_size=640,
                        tensor_model_parallel_size=2):
        assert msg and "student's padded vocabulary 640" in msg and "teacher's 512" in msg


def test_last_stage_called_without_tokens(pool, teacher_dir):
    """Megatron-LM's ``get_batch`` gives the last of several pipeline stages no tokens: the
    teacher takes them from the data iterator's item, and the losses are those of a model
    called with them."""
    argv = ["--kd-ce-weight", "0.2"]
    with_tokens = pool.run(case_pipeline_schedule, teacher_dir, argv)[1]
    without = pool.run(case_pipeline_schedule, teacher_dir, argv, True)[1]
    assert without["reports"] == with_tokens["reports"]
    assert without["grad_norm"] == with_tokens["grad_norm"]


def test_disaggregated_teacher_in_megatron_lm(pool, teacher_dir, replicas, tmp_path):
    """``--kd-mode disaggregated`` through the patched entry points: only the teacher's output
    layer on the student's ranks, hidden states from a replica (``megatron-kd teacher serve``,
    TP 1, for a TP 2 student), fp32 on the wire: the losses and gradients of colocated
    training; evaluation reports the student's cross-entropy only."""
    argv = ["--kd-ce-weight", "0.3"]
    colocated = pool.run(case_train_microbatches, teacher_dir, argv)
    replica = replicas(teacher_dir)
    remote = pool.run(case_train_microbatches, teacher_dir,
                      [*argv, "--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                       str(replica.endpoint), "--kd-wire-dtype", "fp32"])
    for c, r in zip(colocated, remote):
        assert c["teacher_built"] and not c["client"]
        assert r["client"] and not r["teacher_built"]
        assert len(r["reports"]) == 3
        for rep_c, rep_r in zip(c["reports"], r["reports"]):
            assert set(rep_r) == {"total loss", "kd loss", "lm loss"}
            for key in rep_c:
                assert rep_r[key] == pytest.approx(rep_c[key], rel=1e-6), key
        assert r["grad_norm"] == pytest.approx(c["grad_norm"], rel=1e-6)
        assert set(r["eval"]) == {"total loss", "lm loss"}
        assert r["eval"]["total loss"] == pytest.approx(r["eval"]["lm loss"], rel=1e-6)
        assert r["eval"]["lm loss"] == pytest.approx(c["eval"]["lm loss"], rel=1e-6)
    replica.stop()
    assert replica.requests_served() == 3  # one request a training microbatch, none for eval


def case_rerun_steps(ctx, teacher_dir, kd_argv, mode, steps=2, microbatches=2, tp=2):
    """``steps`` steps of ``microbatches`` through the patched forward step, driven as
    Megatron-LM's ``train_step`` drives them: ``while should_run_forward_backward(iterator)``
    of Megatron-Core's rerun state machine in ``mode`` (``report_determinism_stats`` runs every
    step again), the data iterator wrapped in its ``RerunDataIterator``. Per run of a step (the
    first, then the one again): its microbatches' loss reports; the requests the replica was
    sent, as the client counts them."""
    from megatron.core import rerun_state_machine as rsm

    from megatron_kd.integration.cpu_shim import device_context, install_cpu_shim
    from megatron_kd.integration.groups import model_parallel

    install_cpu_shim()
    args = _lm_args([*_teacher_argv(teacher_dir), *kd_argv], tensor_model_parallel_size=tp)
    # a pool worker that ran the forward step before holds the default machine Megatron-Core
    # makes on first use (get_rerun_state_machine); this case starts its own
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode(mode))
    machine = rsm.get_rerun_state_machine()
    if "filename" not in rsm.Caller._fields:
        # megatron-core before 0.17 logs its determinism stats with a field its Caller lacks
        # (AttributeError at every report); nothing of this test is in that report
        machine._maybe_report_stats = lambda: None
    runs = []
    try:
        with megatron_lm_stub(args), model_parallel(tp=tp), device_context(), \
                microbatch_calculator(microbatches):
            model = kd_lm.model_provider(megatron_lm_model_provider, pre_process=True,
                                         post_process=True)
            state = kd_lm.kd_state(model)
            data = rsm.RerunDataIterator(
                iter([make_batch(seed=40 + i) for i in range(steps * microbatches)]))
            try:
                for _ in range(steps):
                    while machine.should_run_forward_backward(data):
                        reports = []
                        for _ in range(microbatches):
                            output, loss_fn = kd_lm.forward_step(megatron_lm_forward_step,
                                                                 data, model)
                            loss, _, report = loss_fn(output)
                            loss.backward()
                            reports.append(report)
                        runs.append(cp_summed_reports(reports))
                sent = state.client.next_request if state.client is not None else None
            finally:
                if state.client is not None:
                    state.client.close()
    finally:
        rsm.destroy_rerun_state_machine()
    return {"runs": runs, "sent": sent, "microbatches": state.microbatches}


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_step_run_again_by_the_rerun_machine(pool, teacher_dir, replicas, disaggregated):
    """Megatron-Core's rerun state machine (``--rerun-mode report_determinism_stats`` runs
    every step twice) replays each step with the same microbatches and the same teacher
    outputs: each run again equals the step's first run, and the first runs equal a run with
    the machine off; the disaggregated teacher is asked once a microbatch, the read-ahead
    untouched. Without the replay the data iterator read ahead hands the next step's
    microbatches to the run again, and the teacher client refuses them as misaligned."""
    argv = ["--kd-ce-weight", "0.3"]
    if disaggregated:
        replica = replicas(teacher_dir)
        argv += ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", str(replica.endpoint),
                 "--kd-wire-dtype", "fp32"]
    off = pool.run(case_rerun_steps, teacher_dir, argv, "disabled")
    again = pool.run(case_rerun_steps, teacher_dir, argv, "report_determinism_stats")
    for o, a in zip(off, again):
        assert len(o["runs"]) == 2 and len(a["runs"]) == 4
        assert a["microbatches"] == o["microbatches"] == 4
        for step in range(2):
            first, rerun = a["runs"][2 * step], a["runs"][2 * step + 1]
            for rep_o, rep_f, rep_r in zip(o["runs"][step], first, rerun):
                for key in rep_o:
                    assert rep_r[key] == rep_f[key], (step, key)  # bit for bit
                    assert rep_f[key] == pytest.approx(rep_o[key], rel=1e-6), (step, key)
        if disaggregated:
            assert a["sent"] == o["sent"]
    if disaggregated:
        replica.stop()
        assert replica.requests_served() == 2 * 4  # the machine off, then on: 4 each


def test_disaggregated_scalars_in_megatron_lm_writer(pool, teacher_dir, replicas, tmp_path):
    """Inside Megatron-LM the teacher's scalars go into Megatron-LM's own TensorBoard writer
    (its last rank's), one point per step, read back with TensorBoard's reader."""
    pytest.importorskip("tensorboard")
    from support.scalars import tensorboard_scalars
    from support.train_cases import TEACHER_ARCH

    replica = replicas(teacher_dir)
    tb = tmp_path / "tb"
    pool.run(case_train_microbatches, teacher_dir,
             ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", str(replica.endpoint),
              "--kd-wire-dtype", "bf16"], tensorboard_dir=str(tb))
    replica.stop()
    scalars = tensorboard_scalars(tb)
    # the last rank's (TP rank 1) half of each microbatch's hidden states, bf16 on the wire;
    # Megatron-core alone has no microbatch calculator: one microbatch a step
    chunk = SEQ // 2 * MBS * TEACHER_ARCH["hidden_size"] * 2
    assert scalars["kd/wire-bytes"] == {1: chunk, 2: chunk, 3: chunk}
    assert scalars["kd/live-replicas"] == {1: 1, 2: 1, 3: 1}
    assert scalars["kd/failovers"] == {1: 0, 2: 0, 3: 0}
    assert set(scalars["kd/teacher-wait-s"]) == {1, 2, 3}
    assert all(v >= 0 for v in scalars["kd/teacher-wait-s"].values())


# --- context parallelism -----------------------------------------------------------------------
# Megatron-LM's get_batch cuts each sequence with Megatron-Core's get_batch_on_this_cp_rank (the
# stand-in forward step calls it); on the CPU the student's and the teacher's attention is
# megatron_kd's ContextParallelAttention. Summed over the CP ranks as Megatron-LM sums them, the
# losses and gradients are those of CP 1: the same sums of fp32 terms in another order (the
# attention's keys gathered, the loss's tokens split), measured <= 1.1e-7 relative on the losses
# and <= 6.4e-7 of each gradient's largest entry (absolute, per entry: small entries are sums
# that cancel).
CP_LOSS_REL, CP_GRAD_REL = 1e-6, 1e-5


def _assert_reports_close(got, want, rel):
    assert len(got) == len(want)
    for rep_got, rep_want in zip(got, want):
        assert set(rep_got) == set(rep_want)
        for key, (loss_sum, tokens) in rep_want.items():
            assert rep_got[key][1] == tokens, key  # every token counted once
            assert rep_got[key][0] == pytest.approx(loss_sum, rel=rel), key


def _assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for name, grad in want.items():
        atol = CP_GRAD_REL * float(grad.abs().max())
        torch.testing.assert_close(got[name], grad, rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _diffs(got, want):
    loss = max((abs(g[k][0] - w[k][0]) / abs(w[k][0]) for g, w in
                zip(got["reports"], want["reports"]) for k in w if w[k][0]), default=0.0)
    grad = max(float((got["grads"][n] - w).abs().max() / w.abs().max())
               for n, w in want["grads"].items())
    return {"loss_rel": loss, "grad_rel_to_max": grad}


@pytest.fixture(scope="module")
def cp2_colocated(pool, teacher_dir):
    """TP 1 x CP 2, colocated: 3 training microbatches and an evaluation one."""
    return pool.run(case_train_microbatches, teacher_dir, ["--kd-ce-weight", "0.3"], tp=1, cp=2)


def test_context_parallel_matches_cp1(pool, teacher_dir, cp2_colocated):
    """``--context-parallel-size 2`` through the patched entry points: the student gets this
    rank's chunks of each sequence, the colocated teacher runs in the student's CP group on the
    same inputs; the losses (training and evaluation, with the teacher's own) and every
    gradient are those of CP 1 (the pool's 2 ranks as data-parallel replicas of one batch)."""
    cp1 = pool.run(case_train_microbatches, teacher_dir, ["--kd-ce-weight", "0.3"], tp=1, cp=1)
    for ref, got in zip(cp1, cp2_colocated):
        assert got["teacher_built"] and not got["client"]
        _assert_reports_close(got["reports"], ref["reports"], CP_LOSS_REL)
        _assert_reports_close([got["eval"]], [ref["eval"]], CP_LOSS_REL)
        assert set(got["eval"]) == {"total loss", "kd loss", "lm loss", "teacher lm loss"}
        _assert_grads_close(got["grads"], ref["grads"])
        if os.environ.get("MEGATRON_KD_PRINT_DIFFS"):  # how close (for the tolerances above)
            print("cp2 vs cp1", _diffs(got, ref))


def test_context_parallel_last_stage_without_tokens(pool, pool4, teacher_dir):
    """PP 2 x CP 2 through megatron-core's schedule: Megatron-LM calls the last stage without
    tokens and the teacher takes the whole sequence from the data iterator's item, cut to this
    rank's chunks; the losses and gradients are those of the last stage called with its
    chunks (exactly), and of PP 2 at CP 1."""
    argv = ["--kd-ce-weight", "0.2"]
    # the loss sums left undivided: the gradients of the whole sequences' sums, summed over
    # the CP ranks (otherwise Megatron-Core divides each rank's by its own token count)
    ref = pool.run(case_pipeline_schedule, teacher_dir, argv, True, per_token_loss=True)
    without = pool4.run(case_pipeline_schedule, teacher_dir, argv, True, cp=2,
                        per_token_loss=True)
    with_tokens = pool4.run(case_pipeline_schedule, teacher_dir, argv, False, cp=2,
                            per_token_loss=True)
    assert [r["last"] for r in without] == [False, False, True, True]  # TP, CP, then PP
    for rank, (w, t) in enumerate(zip(without, with_tokens)):
        assert w["reports"] == t["reports"]
        for name, grad in t["grads"].items():
            assert torch.equal(w["grads"][name], grad), name
        want = ref[rank // 2]  # the same stage at CP 1
        _assert_reports_close(w["reports"], want["reports"], CP_LOSS_REL)
        _assert_grads_close(w["grads"], want["grads"])
        if os.environ.get("MEGATRON_KD_PRINT_DIFFS"):
            print("pp2 cp2 vs cp1", rank, _diffs(w, want))
    assert all(rep["kd loss"][0] > 0 for r in without[2:] for rep in r["reports"])


def test_context_parallel_disaggregated(pool, teacher_dir, replicas, cp2_colocated):
    """``--kd-mode disaggregated`` at CP 2: CP rank 0 (the TP x CP group's first rank) sends
    each microbatch's whole sequence once, the replica (``megatron-kd teacher serve``, CP 1)
    answers each CP rank its chunks; fp32 on the wire, the losses and gradients of the
    colocated teacher at CP 2."""
    replica = replicas(teacher_dir)
    remote = pool.run(case_train_microbatches, teacher_dir,
                      ["--kd-ce-weight", "0.3", "--kd-mode", "disaggregated",
                       "--kd-teacher-endpoint", str(replica.endpoint), "--kd-wire-dtype", "fp32"],
                      tp=1, cp=2)
    for c, r in zip(cp2_colocated, remote):
        assert r["client"] and not r["teacher_built"]
        _assert_reports_close(r["reports"], c["reports"], CP_LOSS_REL)
        _assert_grads_close(r["grads"], c["grads"])
        assert set(r["eval"]) == {"total loss", "lm loss"}
        assert r["eval"]["lm loss"] == pytest.approx(c["eval"]["lm loss"], rel=1e-6)
    replica.stop()
    assert replica.requests_served() == 3  # one request a microbatch for both CP ranks


# --- offline: the top-K cache inside pretrain_gpt.py -------------------------------------------
# A cache of the rows of make_batch(seed) for RUN_SEEDS (what case_train_microbatches and
# case_pipeline_schedule read), stored in reverse order: the run finds its rows by their tokens,
# not by where the data iterator's order would put them.
RUN_SEEDS = (20, 21, 22, 11, 12)
OFFLINE_TOPK = 16


def _cache_rows(seeds):
    return [make_batch(seed)["tokens"][b] for seed in seeds for b in range(MBS)]


def case_build_offline_cache(ctx, teacher_dir, cache_dir, seeds):
    """The top-K cache (K 16, lossless fp32 log-probs) of the teacher over the rows of
    ``make_batch(seed)`` for ``seeds``, in reverse order; rank 0 writes (every rank builds the
    teacher: its load may be collective)."""
    import torch.distributed as dist

    from megatron_kd.cache.build import build_cache
    from megatron_kd.cache.codec import LogprobCodec
    from megatron_kd.cache.format import CacheSpec
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import output_layer_weight, to_sbh

    samples = _cache_rows(seeds)[::-1]
    with model_parallel(tp=1), device_context():
        teacher = _reference_teacher(teacher_dir)
        if ctx.rank == 0:
            def tokens(indices):
                return torch.stack([samples[i] for i in indices])

            @torch.no_grad()
            def forward(indices):
                t = tokens(indices)
                return to_sbh(teacher(t, torch.arange(SEQ).expand_as(t), None))

            spec = CacheSpec(teacher_checkpoint=teacher_dir, teacher_weights_hash="test",
                             tokenizer="test", vocab_size=STUDENT_ARCH["vocab_size"],
                             topk=OFFLINE_TOPK, seq_length=SEQ, num_samples=len(samples),
                             dataset_hash=f"rows of make_batch{tuple(seeds)}",
                             samples_per_shard=4, logprob_codec=LogprobCodec(name="fp32"))
            build_cache(cache_dir, spec, teacher_forward_fn=forward, sample_tokens_fn=tokens,
                        output_weight=output_layer_weight(teacher), micro_batch_size=2)
        dist.barrier()


def case_offline_reference(ctx, cache_dir, kd_argv, seeds, tp=2):
    """``[[loss sum, tokens]]`` of each ``make_batch(seed)``: the student (the same provider
    and seed) bypassed by hand, its top-K targets read by sample index from where
    :func:`case_build_offline_cache` put each row (reverse order), ``vocab_parallel_kd_loss``
    called directly."""
    from megatron.core import parallel_state as ps

    from megatron_kd.cache.loader import topk_batch
    from megatron_kd.cache.reader import TopKCacheReader
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import (
        bypass_output_layer,
        output_layer_weight,
        to_sbh,
    )
    from megatron_kd.loss import TopKTeacher, vocab_parallel_kd_loss
    from megatron_kd.modes.args import KDArgs

    args = _lm_args(["--kd-mode", "offline", "--kd-topk-cache", cache_dir, *kd_argv],
                    tensor_model_parallel_size=tp)
    reader = TopKCacheReader(cache_dir)
    last = len(_cache_rows(RUN_SEEDS)) - 1
    out = []
    with megatron_lm_stub(args), model_parallel(tp=tp), device_context():
        model = bypass_output_layer(megatron_lm_model_provider())
        config = KDArgs.from_args(args).loss_config(vocab_size=STUDENT_ARCH["vocab_size"])
        for seed in seeds:
            batch = make_batch(seed)
            first = RUN_SEEDS.index(seed) * MBS
            ids, logprobs = topk_batch(reader, [last - first - b for b in range(MBS)])
            hidden = to_sbh(model(batch["tokens"], batch["position_ids"], None))
            loss, tokens = vocab_parallel_kd_loss(
                hidden, output_layer_weight(model), TopKTeacher(ids=ids, logprobs=logprobs),
                labels=batch["labels"].t(),
                loss_mask=batch["loss_mask"].t(), config=config,
                tp_group=ps.get_tensor_model_parallel_group())
            out.append([loss.item(), tokens.item()])
    return out


def case_offline_refused(ctx, cache_dir, tp=2, cp=1):
    """The refusal of :func:`case_train_microbatches` offline on ``cache_dir`` (None: none)."""
    try:
        case_train_microbatches(ctx, None, ["--kd-mode", "offline", "--kd-topk-cache",
                                            cache_dir], tp=tp, cp=cp)
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def offline_caches(pool, teacher_dir, tmp_path_factory):
    """``{"run": the run's rows, "other": rows of other batches, "partial": the first two
    microbatches' rows only}``: cache directories built by the teacher."""
    root = tmp_path_factory.mktemp("offline_caches")
    caches = {"run": RUN_SEEDS, "other": (50, 51), "partial": (20, 21)}
    for name, seeds in caches.items():
        pool.run(case_build_offline_cache, teacher_dir, str(root / name), seeds)
    return {name: str(root / name) for name in caches}


OFFLINE_ARGV = ("--kd-ce-weight", "0.3", "--kd-topk-tail", "renormalize")


def test_offline_cache_in_megatron_lm(pool, offline_caches):
    """``--kd-mode offline`` through the patched entry points at TP 2 and at CP 2: each
    microbatch's rows found by its tokens in a cache that holds them in another order; the
    losses are those of the fused loss called directly on the rows the test knows (the same
    fp32 operations: 1e-6), CP 2 sums to TP 2's (1e-5, the CP sum order); evaluation has no
    teacher (the cache holds training samples only)."""
    argv = ["--kd-mode", "offline", "--kd-topk-cache", offline_caches["run"], *OFFLINE_ARGV]
    tp2 = pool.run(case_train_microbatches, None, argv)
    want = pool.run(case_offline_reference, offline_caches["run"], OFFLINE_ARGV, (20, 21, 22))
    cp2 = pool.run(case_train_microbatches, None, argv, tp=1, cp=2)
    for got, ref, cp in zip(tp2, want, cp2):
        assert not got["teacher_built"] and not got["client"]
        assert [r["total loss"] for r in got["reports"]] == [
            pytest.approx(pair, rel=1e-6) for pair in ref]
        assert all(r["kd loss"][0] > 0 for r in got["reports"])
        assert set(got["eval"]) == {"total loss", "lm loss"}, got["eval"]
        _assert_reports_close(cp["reports"], got["reports"], 1e-5)


def test_offline_cache_last_stage_without_tokens(pool, offline_caches):
    """PP 2, the last stage called without tokens (Megatron-LM's ``get_batch``): the rows are
    found from the data iterator's tokens, the losses those of a stage called with them."""
    argv = ["--kd-mode", "offline", "--kd-topk-cache", offline_caches["run"], *OFFLINE_ARGV]
    with_tokens = pool.run(case_pipeline_schedule, None, argv)[1]
    without = pool.run(case_pipeline_schedule, None, argv, True)[1]
    assert len(without["reports"]) == 2 and all(r["kd loss"][0] > 0 for r in without["reports"])
    assert without["reports"] == with_tokens["reports"]
    assert without["grad_norm"] == with_tokens["grad_norm"]


@pytest.mark.parametrize("cache, where", [
    ("other", "sample 0 of microbatch 0 of step 1 (counted from the run's start) on "
              "data-parallel rank 0"),
    ("partial", "sample 0 of microbatch 0 of step 3 (counted from the run's start) on "
                "data-parallel rank 0")])
def test_offline_cache_without_the_samples_refused(pool, offline_caches, cache, where):
    """A cache built for other data stops the run at its first sample; one that lacks a later
    microbatch's samples at that microbatch, before its loss: the sample and the cache named,
    on every TP rank together."""
    for msg in pool.run(case_offline_refused, offline_caches[cache]):
        assert msg is not None and msg.startswith(where), msg
        assert f"the top-K cache {offline_caches[cache]} holds no sample with its tokens" in msg
        assert "No optimizer step was taken" in msg


def test_offline_cache_checked_against_megatron_lm_flags(offline_caches, tmp_path):
    """The cache against Megatron-LM's flags, before anything is built: its sequence length,
    a vocabulary larger than the student's padded one, a directory that is no cache."""
    from megatron_kd.megatron_lm.checks import open_topk_cache

    def opened(cache_dir, **fields):
        args = _lm_args(["--kd-mode", "offline", "--kd-topk-cache", cache_dir], **fields)
        kd, teacher_arch = check_megatron_args(args)
        assert teacher_arch is None
        return open_topk_cache(kd, args)

    assert opened(offline_caches["run"]).spec.topk == OFFLINE_TOPK
    run = offline_caches["run"]
    with pytest.raises(ValueError, match=re.escape(
            f"--kd-topk-cache {run!r} was built for --seq-length {SEQ}, this run has "
            f"--seq-length 64")):
        opened(run, seq_length=64)
    with pytest.raises(ValueError, match=re.escape(
            f"--kd-topk-cache {run!r} holds a teacher vocabulary of 500, more than the "
            f"student's padded vocabulary 256")):
        opened(run, padded_vocab_size=256)
    with pytest.raises(ValueError, match=re.escape(
            f"--kd-topk-cache {str(tmp_path)!r}: {tmp_path}/manifest.json: no manifest")):
        opened(str(tmp_path))


# --- several teachers --------------------------------------------------------------------------
# --kd-mode once per teacher: a weighted mixture. Its loss is sum_i w_i * L_i (each teacher's
# fused loss, the CE once; weights normalized to sum 1), so with the student's weights held
# (no optimizer step between microbatches) its total loss and gradients are the weighted sums of
# the one-teacher runs', and each teacher's own KD loss is that teacher's run's "kd loss".

@pytest.fixture(scope="module")
def other_teacher_dir(pool, tmp_path_factory):
    """A second teacher: the tier teacher's architecture, other weights."""
    from support.train_cases import TEACHER_ARCH, case_make_teacher

    d = str(tmp_path_factory.mktemp("other_teacher") / "ckpt")
    pool.run(case_make_teacher, d, TEACHER_ARCH, 11)
    return d


def test_two_colocated_teachers_are_the_weighted_one_teacher_runs(pool, teacher_dir,
                                                                  other_teacher_dir):
    """Two colocated teachers, weights 1 3, at TP 2 with ``--sequence-parallel`` through the
    patched entry points: each microbatch reports each teacher's KD loss (``kd loss teacher
    <i>``) equal to that teacher's run alone, ``kd loss`` their weighted sum, and the total loss
    and every gradient are 1/4 and 3/4 of the one-teacher runs' (fp32, the same operations but
    for the weighting: 1e-5); evaluation reports them too."""
    argv = ["--kd-ce-weight", "0.3", "--kd-temperature", "1.5"]
    run = partial(pool.run, case_train_microbatches, None, sequence_parallel=True)
    mixed = run([*argv, "--kd-mode", "colocated", "colocated", "--kd-teacher-load", teacher_dir,
                 other_teacher_dir, "--kd-teacher-weights", "1", "3"])
    alone = [run([*argv, "--kd-teacher-load", d]) for d in (teacher_dir, other_teacher_dir)]
    for m, a0, a1 in zip(mixed, *alone, strict=True):
        assert m["teacher_built"] and not m["client"]
        assert len(m["reports"]) == 3
        for rep, rep0, rep1 in zip(m["reports"] + [m["eval"]], a0["reports"] + [a0["eval"]],
                                   a1["reports"] + [a1["eval"]], strict=True):
            assert set(rep) == {"total loss", "kd loss", "lm loss", "kd loss teacher 0",
                                "kd loss teacher 1"}
            assert rep["kd loss teacher 0"] == pytest.approx(rep0["kd loss"], rel=1e-5)
            assert rep["kd loss teacher 1"] == pytest.approx(rep1["kd loss"], rel=1e-5)
            assert rep["kd loss teacher 0"][0] != pytest.approx(rep["kd loss teacher 1"][0],
                                                                rel=1e-3)  # two teachers
            assert rep["kd loss"][0] == pytest.approx(
                0.25 * rep0["kd loss"][0] + 0.75 * rep1["kd loss"][0], rel=1e-5)
            assert rep["lm loss"] == pytest.approx(rep0["lm loss"], rel=1e-6)
        for rep, rep0, rep1 in zip(m["reports"], a0["reports"], a1["reports"]):
            assert rep["total loss"][0] == pytest.approx(
                0.25 * rep0["total loss"][0] + 0.75 * rep1["total loss"][0], rel=1e-5)
        assert m["grads"].keys() == a0["grads"].keys()
        for name, grad in m["grads"].items():
            want = 0.25 * a0["grads"][name] + 0.75 * a1["grads"][name]
            torch.testing.assert_close(grad, want, rtol=1e-5,
                                       atol=1e-5 * float(want.abs().max()), msg=name)


def test_several_teachers_checked_each(monkeypatch):
    """Each teacher is checked as one is, in ``--kd-mode`` order (its architecture returned,
    its directory resolved); teachers of different vocabularies are refused naming each size,
    and two disaggregated teachers (the data iterator is read ahead for one) naming the
    modes."""
    import dataclasses

    from support.train_cases import TEACHER_ARCH

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.megatron_lm import checks
    from megatron_kd.megatron_lm.checks import check_megatron_teachers

    archs = {"/a": GPTArchConfig(**TEACHER_ARCH),
             "/b": dataclasses.replace(GPTArchConfig(**TEACHER_ARCH), hidden_size=48),
             "/small": dataclasses.replace(GPTArchConfig(**TEACHER_ARCH), vocab_size=400)}
    # the checkpoints' own checks (tensors against the architecture) are not this test's
    monkeypatch.setattr(checks, "check_teacher", lambda load, **kw: (load + "/iter", archs[load]))
    two = ["--kd-mode", "colocated", "disaggregated", "--kd-teacher-endpoint", "/e",
           "--kd-teacher-weights", "1", "3"]
    kd, got = check_megatron_teachers(_lm_args([*two, "--kd-teacher-load", "/a", "/b"]))
    assert got == (archs["/a"], archs["/b"])
    assert [(t.mode, t.teacher_load) for t in kd.teachers] == [
        ("colocated", "/a/iter"), ("disaggregated", "/b/iter")]
    assert kd.weights == (0.25, 0.75)
    assert check_megatron_args(_lm_args([*two, "--kd-teacher-load", "/a", "/b"]))[1] is archs["/a"]
    with pytest.raises(ValueError, match=re.escape(
            "the teachers' vocabularies differ (teacher 0 (--kd-mode colocated /a/iter): 500 "
            "tokens; teacher 1 (--kd-mode disaggregated /small/iter): 400 tokens)")):
        check_megatron_teachers(_lm_args([*two, "--kd-teacher-load", "/a", "/small"]))
    with pytest.raises(ValueError, match=re.escape(
            "--kd-mode disaggregated disaggregated: Megatron-LM's pretrain_gpt.py takes at most "
            "one disaggregated teacher (teachers [0, 1] are)")):
        check_megatron_teachers(_lm_args(["--kd-mode", "disaggregated", "disaggregated",
                                          "--kd-teacher-load", "/a", "/b",
                                          "--kd-teacher-endpoint", "/e", "/f"]))


def _model_dir(path, **arch):
    """A directory with only a ``model_config.json`` (what the pretrained hook reads)."""
    import json

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import CHECKPOINT_FORMAT_VERSION

    os.makedirs(path)
    config = GPTArchConfig(**{**STUDENT_ARCH, "padded_vocab_size": 512, **arch}).to_dict()
    with open(os.path.join(path, "model_config.json"), "w", encoding="utf-8") as f:
        json.dump({"format_version": CHECKPOINT_FORMAT_VERSION, "arch": config}, f)
    return str(path)


def _student_fields(**fields):
    return {"num_layers": STUDENT_ARCH["num_layers"], "hidden_size": STUDENT_ARCH["hidden_size"],
            "num_attention_heads": STUDENT_ARCH["num_attention_heads"],
            "group_query_attention": True, "num_query_groups": STUDENT_ARCH["num_query_groups"],
            "ffn_hidden_size": STUDENT_ARCH["ffn_hidden_size"], **fields}


def test_pretrained_checkpoint_of_ours_becomes_a_release_view(tmp_path):
    """``--pretrained-checkpoint`` naming an ``import-hf`` directory: Megatron-LM is handed a
    ``release`` root pointing at it (once, however often the hooks ask); another
    architecture is refused naming both values; a Megatron-LM checkpoint is left alone. The
    real ``pretrain_gpt.py`` loading it: tests/e2e/test_megatron_lm_real_export.py."""
    model = _model_dir(tmp_path / "imported")
    args = _lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"],
                    **_student_fields(pretrained_checkpoint=model))
    check_megatron_args(args)
    view = args.pretrained_checkpoint
    assert view != model
    assert os.path.realpath(os.path.join(view, "release")) == os.path.realpath(model)
    with open(os.path.join(view, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        assert f.read() == "release"
    check_megatron_args(args)  # the next model chunk
    assert args.pretrained_checkpoint == view

    other = _model_dir(tmp_path / "other", num_layers=3)
    with pytest.raises(ValueError, match=re.escape(f"--pretrained-checkpoint {other!r} holds a "
                                                   f"model with --num-layers 3, but this run "
                                                   f"builds 2")):
        check_megatron_args(_lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"],
                                     **_student_fields(pretrained_checkpoint=other)))

    megatron_lm_root = tmp_path / "mlm"
    (megatron_lm_root / "iter_0000001").mkdir(parents=True)
    (megatron_lm_root / "latest_checkpointed_iteration.txt").write_text("1")
    args = _lm_args(["--kd-weight", "0", "--kd-ce-weight", "1"],
                    **_student_fields(pretrained_checkpoint=str(megatron_lm_root)))
    check_megatron_args(args)
    assert args.pretrained_checkpoint == str(megatron_lm_root)
