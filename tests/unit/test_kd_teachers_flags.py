"""Several teachers on the command line (tier 1, no process group): the per-teacher ``--kd-*``
flags dealt to the teachers ``--kd-mode`` names, their refusals, a mixture's step statistics as
logged, and the Megatron-style loss function of a mixture against the loss it calls."""

import argparse

import pytest
import torch

from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.loss import (
    DenseTeacher,
    KDLossConfig,
    TeacherMixture,
    TopKTeacher,
    mixture_kd_loss,
)
from megatron_kd.modes.args import KDArgs, add_kd_args
from megatron_kd.modes.stats import CacheStepStats, MixtureStepStats, RemoteStepStats
from megatron_kd.teacher.step_stats import ClientStepStats


def parse(line: str) -> argparse.Namespace:
    return add_kd_args(argparse.ArgumentParser()).parse_args(line.split())


def kd_of(line: str) -> KDArgs:
    return KDArgs.from_args(parse(line))


def test_one_teacher_is_todays_namespace_and_args():
    ns = parse("--kd-mode disaggregated --kd-teacher-load /t --kd-teacher-endpoint h:1")
    # one value stays one value: code reading the namespace sees what it always saw
    assert (ns.kd_mode, ns.kd_teacher_load, ns.kd_teacher_endpoint) == \
        ("disaggregated", "/t", "h:1")
    assert ns.kd_teacher_weights is None
    kd = KDArgs.from_args(ns)
    assert kd.teachers == (kd,) and kd.extra_teachers == () and kd.weights == (1.0,)
    assert kd == KDArgs(mode="disaggregated", teacher_load="/t", teacher_endpoint="h:1",
                        loss=kd.loss)
    default = kd_of("--kd-weight 0 --kd-ce-weight 1")
    assert default == KDArgs(loss=default.loss) and default.teachers == (default,)


def test_values_are_dealt_in_mode_order():
    kd = kd_of("--kd-mode offline colocated disaggregated --kd-teacher-load /8b /70b "
               "--kd-teacher-endpoint host:5000 --kd-topk-cache /cache --kd-teacher-dtype bf16 "
               "--kd-teacher-weights 1 1 2")
    rows = [(t.mode, t.teacher_load, t.teacher_endpoint, t.topk_cache, t.teacher_dtype)
            for t in kd.teachers]
    assert rows == [("offline", None, None, "/cache", "fp32"),
                    ("colocated", "/8b", None, None, "bf16"),
                    ("disaggregated", "/70b", "host:5000", None, "bf16")]
    assert kd.weights == (0.25, 0.25, 0.5)
    # each teacher is a one-teacher KDArgs with the run's loss and shared flags
    assert all(t.loss == kd.loss and t.prefetch_depth == kd.prefetch_depth
               and t.extra_teachers == () for t in kd.teachers)
    per_loaded = kd_of("--kd-mode colocated colocated --kd-teacher-load /a /b "
                       "--kd-teacher-dtype bf16 fp32 --kd-teacher-args '--x' '--y'")
    assert [(t.teacher_dtype, t.teacher_args) for t in per_loaded.teachers] == \
        [("bf16", "'--x'"), ("fp32", "'--y'")]
    assert per_loaded.weights == (0.5, 0.5)  # equal by default


@pytest.mark.parametrize("line, message", [
    ("--kd-mode colocated colocated --kd-teacher-load /a",
     r"--kd-teacher-load /a: 1 value\(s\) for the 2 colocated or disaggregated teacher\(s\) of "
     r"--kd-mode colocated colocated"),
    ("--kd-mode colocated disaggregated --kd-teacher-load /a /b",
     r"--kd-teacher-endpoint \(not given\): 0 value\(s\) for the 1 disaggregated teacher"),
    ("--kd-mode offline offline --kd-topk-cache /c",
     r"--kd-topk-cache /c: 1 value\(s\) for the 2 offline teacher"),
    ("--kd-mode colocated colocated --kd-teacher-load /a /b --kd-teacher-dtype bf16 fp32 fp32",
     r"--kd-teacher-dtype bf16 fp32 fp32: 3 value\(s\) for the 2"),
    ("--kd-mode colocated --kd-teacher-load /a /b",
     r"--kd-teacher-load /a /b: 2 values for one teacher \(--kd-mode colocated\)"),
    ("--kd-mode colocated colocated --kd-teacher-load /a /b --kd-teacher-weights 1",
     r"--kd-teacher-weights 1.0 for 2 teacher\(s\): 1 weights \[1.0\] for 2 teachers"),
    ("--kd-mode colocated colocated --kd-teacher-load /a /b --kd-teacher-weights 0 0",
     r"weights \[0.0, 0.0\] are all 0"),
    ("--kd-mode colocated colocated --kd-teacher-load /a /b --kd-teacher-weights 1 -1",
     r"weight 1 of teacher 1 must be finite and >= 0, got -1.0"),
    ("--kd-mode colocated colocated --kd-teacher-load /a /b --kd-loss jsd",
     r"--kd-loss jsd with 2 teachers: a mixture of teachers is trained on forward KL only.*"
     r"Use --kd-loss forward_kl, or one teacher"),
    ("--kd-mode colocated offline --kd-teacher-load /a --kd-topk-cache /c "
     "--kd-loss-elementwise compiled",
     r"--kd-loss-elementwise compiled needs a dense teacher"),
])
def test_refusals_name_the_flag_and_the_counts(line, message):
    with pytest.raises(ValueError, match=message):
        kd_of(line)


def test_a_bad_mode_in_the_list_is_argparses_error(capsys):
    with pytest.raises(SystemExit):
        parse("--kd-mode colocated remote")
    assert "invalid choice: 'remote'" in capsys.readouterr().err


def test_mixture_step_stats_are_named_per_teacher():
    remote = RemoteStepStats(client=ClientStepStats(
        bytes_received=4096, bytes_sent=64, failovers=[{"event": "failover", "dp_rank": 0}],
        tokens_by_replica={"r1": 128}))
    cache = CacheStepStats(wait_s=0.5, tokens=100, decode_s=2.0, readers=1)
    stats = MixtureStepStats(parts=(cache, remote))
    fields = stats.log_fields(step_time_s=2.0)
    assert fields == {"kd_teachers": [cache.log_fields(2.0), remote.log_fields(2.0)]}
    assert stats.events == [{"event": "failover", "dp_rank": 0, "teacher": 1}]
    scalars = stats.scalars(2.0)
    assert scalars["kd/teacher-0/cache-wait-s"] == 0.5
    assert scalars["kd/teacher-1/wire-bytes"] == 4096.0
    assert scalars["kd/teacher-1/replica-r1/tokens-per-s"] == 64.0
    assert not any(name.startswith("kd/wire") for name in scalars)


def _loss_inputs():
    g = torch.Generator().manual_seed(3)
    s, b, h, v, k = 6, 2, 8, 40, 5
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    dense = DenseTeacher(hidden=torch.randn(s, b, 12, generator=g),
                         weight=torch.randn(v, 12, generator=g))
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(s * b)]).view(s, b, k)
    topk = TopKTeacher(ids=ids, logprobs=torch.log_softmax(torch.randn(s, b, k, generator=g), -1))
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    return hidden, weight, dense, topk, labels, mask


def test_loss_func_of_a_mixture_is_mixture_kd_loss_with_each_teacher_reported():
    hidden, weight, dense, topk, labels, mask = _loss_inputs()
    config = KDLossConfig(temperature=2.0, ce_weight=0.3)
    mixture = TeacherMixture((dense, topk), (1.0, 3.0))
    loss_sum, n, report = make_kd_loss_func(
        student_weight=weight, teacher=mixture, labels=labels, loss_mask=mask,
        config=config, report_agreement=True)(hidden)
    terms = {}
    ref, ref_n = mixture_kd_loss(hidden.transpose(0, 1), weight, (dense, topk), (1.0, 3.0),
                                 labels=labels.transpose(0, 1), loss_mask=mask.transpose(0, 1),
                                 config=config, terms_out=terms)
    assert torch.equal(loss_sum, ref) and int(n) == int(ref_n)
    assert torch.equal(report["kd_loss"][0], terms["kd_sum"].float())
    for i in range(2):
        assert torch.equal(report[f"kd_loss_{i}"][0], terms["teacher_kd_sums"][i].float())
    assert torch.equal(report["lm_loss"][0], terms["ce_sum"].float())
    # the weighted sum of the per-teacher KDs; no agreement for a mixture
    assert float(report["kd_loss"][0]) == pytest.approx(
        0.25 * float(report["kd_loss_0"][0]) + 0.75 * float(report["kd_loss_1"][0]), rel=1e-6)
    assert "kd_kl" not in report and "top1_agreement" not in report
    grads = torch.autograd.grad(loss_sum, (hidden, weight))
    ref_grads = torch.autograd.grad(
        mixture_kd_loss(hidden.transpose(0, 1), weight, (dense, topk), (1.0, 3.0),
                        labels=labels.transpose(0, 1), loss_mask=mask.transpose(0, 1),
                        config=config)[0], (hidden, weight))
    for mine, theirs in zip(grads, ref_grads):
        assert torch.equal(mine, theirs)


def test_loss_func_of_a_mixture_refuses_another_loss():
    hidden, weight, dense, topk, labels, mask = _loss_inputs()
    with pytest.raises(ValueError, match="a mixture of teachers is trained on mixture_kd_loss"):
        make_kd_loss_func(student_weight=weight, teacher=TeacherMixture((dense, topk), (1, 1)),
                          labels=labels, loss_mask=mask, config=KDLossConfig(),
                          loss_fn=lambda *a, **k: None)


def test_teacher_mixture_checks_its_weights():
    _, _, dense, topk, _, _ = _loss_inputs()
    with pytest.raises(ValueError, match="1 weights"):
        TeacherMixture((dense, topk), (1.0,))
