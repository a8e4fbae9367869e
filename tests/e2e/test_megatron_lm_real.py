"""The real Megatron-LM ``pretrain_gpt.py``, patched, on CPU: its losses, ``megatron-kd train``'s.

Runs only with Megatron-LM checkouts (read-only; nothing of them is copied here):

    MEGATRON_LM_DIR=/src/Megatron-LM-f88b85f:/src/Megatron-LM-main \\
    MEGATRON_LM_PYTHON=/venv312/bin/python  python -m pytest tests/e2e/test_megatron_lm_real.py

``MEGATRON_LM_PYTHON`` (default: this interpreter) must be Python >= 3.12 (Megatron-LM's own
requirement since mid 2026) with torch, triton, numpy, packaging, pybind11 and psutil
(Megatron-LM's checkpoint save wants it), and each checkout's dataset helpers built (``make`` in
its ``megatron/core/datasets`` with that interpreter first on ``PATH``); each checkout goes
first on its ``PYTHONPATH``, so its own ``megatron.core`` runs it. Each checkout's patch
(``patches/README.md``) is applied to a copy of its ``pretrain_gpt.py`` in a temporary
directory, unless the checkout has it applied already. ``tests/support/megatron_lm_cpu.py``
(test-only) replaces Megatron-LM's CUDA-only start-up; with ``--context-parallel-size > 1`` it
builds megatron_kd's ``ContextParallelAttention``
(:class:`megatron_kd.integration.context_parallel.ContextParallelAttention`) where Megatron-LM's
local spec builds Megatron-Core's ``DotProductAttention`` (which asserts context-parallel size 1;
on a GPU Transformer Engine's attention splits the sequence), and those layouts run with
``--no-create-attention-mask-in-dataloader`` (the stand-in takes causal masks only). The same
tiny configuration then runs through Megatron-LM and through ``megatron-kd train`` (this
interpreter, its installed megatron-core) on each of :data:`LAYOUTS` (TP1, TP2, PP2, TP2 with
``--sequence-parallel``, a mixture-of-experts student at TP2 with ``--sequence-parallel`` and its
experts over 2 expert-parallel ranks, CP2, PP2 x CP2, TP2 x CP2 with ``--sequence-parallel``,
PP2 with 2 virtual stages a rank), for 5
iterations on the same indexed text and the same teacher: fp32, the per-iteration total, KD and
LM losses equal within 1e-5 relative (Megatron-LM prints 7 digits; ``-s`` prints both sides),
Megatron-LM's printed arguments show the layout it ran, and the evaluation at iteration 5 runs
through the teacher on every layout (PP2: the last stage gets no tokens from Megatron-LM's
``get_batch``; CP2: each rank's teacher takes its chunks of each sequence). Evaluation values
are not compared: Megatron-LM evaluates on the validation batches that follow the previous
evaluation's, ``megatron-kd train`` on the first ``--eval-iters`` batches each time. CP2 with
``--kd-mode disaggregated`` (a ``megatron-kd teacher serve`` replica at CP 1 and at CP 2, fp32
on the wire) gives the same losses as ``megatron-kd train``'s colocated CP2, with one request a
microbatch for both CP ranks. ``--kd-mode offline`` on a cache ``megatron-kd cache build``
made with the run's data flags gives ``megatron-kd train --kd-mode offline``'s losses at DP 2
and TP 2 (1e-5 relative), and a cache built for other data (``--mock-data``) stops the run
before its first iteration naming its first sample and the cache. Two colocated teachers
(weights 1 3, TP 2 with ``--sequence-parallel``) give ``megatron-kd train``'s two-teacher losses
and each teacher's own KD loss (1e-5 relative).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from megatron_kd.megatron_lm import hooks as kd_lm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "tests", "support", "megatron_lm_cpu.py")
ITERS = 5

# The same configuration for both, in the flags both spell the same way.
COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "32",
          "--max-position-embeddings", "64", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-2",
          "--lr-warmup-iters", "1", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
          "--clip-grad", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
          "--adam-eps", "1e-8", "--weight-decay", "0.01", "--init-method-std", "0.02",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "90,5,5",
          "--eval-iters", "1", "--eval-interval", str(ITERS), "--seed", "1234",
          "--kd-ce-weight", "0.5"]
# What Megatron-LM needs said (its defaults differ from megatron-kd train's), on the CPU.
MEGATRON_LM_ONLY = ["--group-query-attention", "--normalization", "RMSNorm", "--swiglu",
                    "--position-embedding-type", "rope", "--disable-bias-linear",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
                    "--make-vocab-size-divisible-by", "128", "--distributed-backend", "gloo",
                    "--transformer-impl", "local", "--use-cpu-initialization",
                    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
                    "--log-interval", "1", "--save-interval", "1000"]


@dataclass(frozen=True)
class Layout:
    """A parallel layout: its ranks, the flags both spell the same way, and what Megatron-LM
    needs said besides."""

    nproc: int
    flags: tuple[str, ...] = ()
    megatron_lm_flags: tuple[str, ...] = ()
    megatron_lm_args: tuple[tuple[str, str], ...] = ()
    """Megatron-LM's arguments as its log prints them, after its own checks: the layout ran as
    asked (sequence parallelism, for one, leaves the losses as they are)."""


TP2 = ("--tensor-model-parallel-size", "2")
# A small mixture-of-experts student, its experts split over the two TP ranks (expert TP 1), as
# megatron-kd train routes: dropless top 2, all-to-all dispatch, no load-balancing loss.
MOE_TP2_SP = ("--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
CP2 = ("--context-parallel-size", "2")
NO_MASK = ("--no-create-attention-mask-in-dataloader",)
CP2_ARGS = (("context_parallel_size", "2"), ("create_attention_mask_in_dataloader", "False"))
LAYOUTS = {
    "tp1": Layout(1),
    "tp2": Layout(2, TP2),
    "pp2": Layout(2, ("--pipeline-model-parallel-size", "2")),
    # with Megatron-LM's spiky-loss check on (its NaN check is on by default): the --kd-* loss
    # goes to its rerun state machine, which lets it through
    "tp2_sp": Layout(2, (*TP2, "--sequence-parallel"), ("--check-for-spiky-loss",),
                     (("sequence_parallel", "True"), ("check_for_spiky_loss", "True"),
                      ("check_for_nan_in_loss_and_grad", "True"))),
    "moe_tp2_sp": Layout(2, (*TP2, "--sequence-parallel", *MOE_TP2_SP),
                         ("--moe-token-dispatcher-type", "alltoall",
                          "--moe-router-load-balancing-type", "none"),
                         (("sequence_parallel", "True"), ("num_experts", "4"),
                          ("expert_model_parallel_size", "2"),
                          ("moe_token_dispatcher_type", "alltoall"))),
    # context parallelism: each rank holds 2 of the 4 chunks of each sequence; the launcher's
    # ContextParallelAttention takes causal masks only (no dataloader mask)
    "cp2": Layout(2, CP2, NO_MASK, CP2_ARGS),
    # and on the last of 2 stages, which Megatron-LM's get_batch calls without tokens
    "pp2_cp2": Layout(4, (*CP2, "--pipeline-model-parallel-size", "2"), NO_MASK, CP2_ARGS),
    # and with sequence parallelism: each rank's chunks split again over the 2 TP ranks
    "tp2_sp_cp2": Layout(4, (*TP2, "--sequence-parallel", *CP2), NO_MASK,
                         (*CP2_ARGS, ("sequence_parallel", "True"))),
    # 4 layers, one a virtual stage: each rank holds two chunks (interleaved schedule)
    "pp2_vp2": Layout(2, ("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                          "--num-layers-per-virtual-pipeline-stage", "1"),
                      megatron_lm_args=(("virtual_pipeline_model_parallel_size", "2"),)),
}
KEYS = ("total loss", "kd loss", "lm loss")

pytestmark = pytest.mark.filterwarnings("ignore")


def _checkouts():
    return [d for d in os.environ.get("MEGATRON_LM_DIR", "").split(os.pathsep) if d]


def _megatron_lm_python():
    exe = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    version = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"],
                             capture_output=True, text=True, check=False).stdout.strip()
    if version != "True":
        pytest.skip(f"Megatron-LM needs Python >= 3.12; MEGATRON_LM_PYTHON={exe!r} is not")
    return exe


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, dist_pool_factory):
    """The indexed text, its tokenizer and the teacher checkpoint, made once."""
    if not _checkouts():
        pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)")
    pytest.importorskip("tokenizers")
    from support.text import TEXT, write_tokenizer
    from support.train_cases import TEACHER_ARCH, case_make_teacher

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    tmp = tmp_path_factory.mktemp("megatron_lm_real")
    (tmp / "text").mkdir()
    (tmp / "text" / "part.txt").write_text(TEXT * 40, encoding="utf-8")
    tok = write_tokenizer(tmp / "tokenizer.json")
    preprocess([str(tmp / "text")], HFTokenizer(tok), str(tmp / "corpus"))
    teacher = str(tmp / "teacher")
    arch = dict(TEACHER_ARCH, init_method_std=0.25)
    dist_pool_factory(2).run(case_make_teacher, teacher, arch)
    return {"dir": tmp, "tokenizer": tok, "data": str(tmp / "corpus"), "teacher": teacher}


def _patched_script(root, tmp):
    """``pretrain_gpt.py`` of ``root`` with its patch applied (a copy, unless applied there)."""
    kind = "model_provider" if _git(root, "rev-parse", "HEAD") == \
        kd_lm.PINNED_MEGATRON_LM_COMMIT else "model_builder"
    patch = os.path.join(REPO, "patches", kd_lm.PATCHES[kind])
    script = os.path.join(root, "pretrain_gpt.py")
    applied = subprocess.run(["git", "-C", root, "apply", "--reverse", "--check", patch],
                             capture_output=True, check=False).returncode == 0
    if applied:
        return script
    copy = tmp / f"patched_{os.path.basename(root)}"
    copy.mkdir()
    shutil.copy(script, copy / "pretrain_gpt.py")
    subprocess.run(["patch", "-p1", "-s", "-d", str(copy), "-i", patch], check=True)
    return str(copy / "pretrain_gpt.py")


def _git(root, *argv):
    return subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True,
                          check=False).stdout.strip()


def _torchrun(python, nproc, argv, env):
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), *argv], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    if proc.returncode and os.environ.get("MEGATRON_LM_FAILED_LOG"):
        with open(os.environ["MEGATRON_LM_FAILED_LOG"], "w", encoding="utf-8") as f:
            f.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return proc.stdout + proc.stderr


_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_VALUE = re.compile(r"(total loss|kd loss|lm loss): ([0-9.E+-]+)")
_VALID = re.compile(r"validation loss at iteration \d+ \|(.*)")
_VALID_VALUE = re.compile(r"(total loss|kd loss|lm loss|teacher lm loss) value: ([0-9.E+-]+)")


def megatron_lm_losses(log):
    """``({iteration: {key: value}}, {key: validation value})`` from Megatron-LM's log.

    Megatron-LM logs iteration 1 without clearing its sums, so its iteration-2 line is the mean
    of iterations 1 and 2: undone here (2 x line 2 - line 1)."""
    lines = {int(m.group(1)): {k: float(v) for k, v in _VALUE.findall(m.group(2))}
             for m in map(_LINE.search, log.splitlines()) if m}
    if 1 in lines and 2 in lines:
        lines[2] = {k: 2 * lines[2][k] - lines[1][k] for k in lines[2]}
    valid = next((m.group(1) for m in map(_VALID.search, log.splitlines()) if m), "")
    return lines, {k: float(v) for k, v in _VALID_VALUE.findall(valid)}


def _megatron_kd_losses(log_json):
    with open(log_json, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = {r["step"]: {"total loss": r["loss"], "kd loss": r["kd_loss"],
                         "lm loss": r["lm_loss"]} for r in records if "step_time_s" in r}
    ev = next(r for r in records if r.get("eval"))
    return steps, {"total loss": ev["eval_loss"], "kd loss": ev["eval_kd_loss"],
                   "lm loss": ev["eval_lm_loss"], "teacher lm loss": ev["eval_teacher_lm_loss"]}


@pytest.fixture(scope="module")
def reference(inputs):
    """``megatron-kd train`` on a layout (this interpreter), run once per layout when first
    asked for."""
    done = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")

    def run(name):
        if name not in done:
            layout = LAYOUTS[name]
            log = str(inputs["dir"] / f"kd_{name}.jsonl")
            _torchrun(sys.executable, layout.nproc, [
                "-m", "megatron_kd", "train", *COMMON, *layout.flags, "--data-path",
                inputs["data"], "--tokenizer-model", inputs["tokenizer"], "--kd-teacher-load",
                inputs["teacher"], "--log-json", log, "--no-progress"], env)
            done[name] = _megatron_kd_losses(log)
        return done[name]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_real_pretrain_gpt_matches_megatron_kd_train(inputs, reference, layout, tmp_path):
    python = _megatron_lm_python()
    spec = LAYOUTS[layout]
    want_steps, want_valid = reference(layout)
    assert want_valid["teacher lm loss"] > 0
    assert sorted(want_steps) == list(range(1, ITERS + 1))
    for root in _checkouts():
        log = _pretrain_gpt(python, root, tmp_path, spec.nproc, [
            *COMMON, *MEGATRON_LM_ONLY, *spec.flags, *spec.megatron_lm_flags,
            "--data-path", inputs["data"], "--kd-teacher-load", inputs["teacher"]])
        got_steps, got_valid = megatron_lm_losses(log)
        for name, value in spec.megatron_lm_args:
            assert re.search(rf"^\s*{name} \.+ {re.escape(value)}$", log, re.MULTILINE), (
                root, name, value)
        _assert_steps_match(got_steps, want_steps,
                            f"{layout} {_git(root, 'rev-parse', '--short', 'HEAD')}")
        assert set(got_valid) == set(want_valid) and all(v > 0 for v in got_valid.values())


def _pretrain_gpt(python, root, tmp_path, nproc, argv):
    """The log of checkout ``root``'s patched ``pretrain_gpt.py`` run over ``nproc`` CPU ranks
    through the test-only launcher."""
    # CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM asserts it for TP > 1 (a CUDA setting)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
               PATH=os.pathsep.join([os.path.dirname(python), os.environ["PATH"]]))
    log = _torchrun(python, nproc, [LAUNCHER, _patched_script(root, tmp_path), *argv], env)
    assert sorted(megatron_lm_losses(log)[0]) == list(range(1, ITERS + 1)), (root, log[-3000:])
    return log


def _assert_steps_match(got_steps, want_steps, label):
    """Every iteration's total, KD and LM loss within 1e-5 relative (printed with ``-s``)."""
    for it in range(1, ITERS + 1):
        print(f"{label} iteration {it}: "
              + ", ".join(f"{key} {got_steps[it][key]:.7g} (megatron-kd train "
                          f"{want_steps[it][key]:.8g})" for key in KEYS))
        for key in KEYS:
            assert got_steps[it][key] == pytest.approx(want_steps[it][key], rel=1e-5), (
                label, it, key, got_steps[it][key], want_steps[it][key])


@pytest.mark.parametrize("replica_cp", [1, 2])
def test_real_pretrain_gpt_context_parallel_disaggregated(inputs, reference, replicas, tmp_path,
                                                          replica_cp):
    """``--context-parallel-size 2 --kd-mode disaggregated`` inside the real ``pretrain_gpt.py``:
    CP rank 0 sends each microbatch's whole sequence, the replica (``megatron-kd teacher
    serve`` at CP ``replica_cp``: the two CP sizes are independent) answers each CP rank its
    chunks; fp32 on the wire, every iteration's losses are ``megatron-kd train``'s with the
    colocated teacher at CP 2, 1e-5 relative. Evaluation has no teacher there (the replicas
    stream training microbatches only)."""
    python = _megatron_lm_python()
    want_steps, _ = reference("cp2")
    replica = replicas(inputs["teacher"], cp=replica_cp)
    spec = LAYOUTS["cp2"]
    for root in _checkouts():
        log = _pretrain_gpt(python, root, tmp_path, spec.nproc, [
            *COMMON, *MEGATRON_LM_ONLY, *spec.flags, *spec.megatron_lm_flags, "--data-path",
            inputs["data"], "--kd-teacher-load", inputs["teacher"], "--kd-mode",
            "disaggregated", "--kd-teacher-endpoint", str(replica.endpoint),
            "--kd-wire-dtype", "fp32"])
        got_steps, got_valid = megatron_lm_losses(log)
        _assert_steps_match(got_steps, want_steps,
                            f"cp2 disaggregated (replica cp {replica_cp}) "
                            f"{_git(root, 'rev-parse', '--short', 'HEAD')}")
        assert set(got_valid) == {"total loss", "lm loss"}, got_valid
    replica.stop()
    # one request a training microbatch (2 a step) for both CP ranks together, and at most
    # --kd-prefetch-depth (2) more that went ahead of the last step: not one per CP rank
    runs = len(_checkouts())
    assert 2 * ITERS * runs <= replica.requests_served() <= (2 * ITERS + 2) * runs


# The tiny teacher (support.train_cases.TEACHER_ARCH) in Megatron-LM's flags.
TEACHER_FLAGS = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4",
                 "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
                 "--max-position-embeddings", "64", "--position-embedding-type", "rope",
                 "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                 "--vocab-size", "500"]


def test_real_megatron_lm_checkpoint_as_teacher(inputs, tmp_path):
    """Megatron-LM itself writes the teacher: ``pretrain_gpt.py`` (KD off) loads the tiny
    teacher's weights (``--finetune``) and saves them after one step at learning rate 0 (Adam
    then changes nothing). Distilling from that ``torch_dist`` checkpoint, its architecture
    given as the same flags or read from the arguments Megatron-LM saved in it, gives the
    losses of the original checkpoint exactly."""
    python = _megatron_lm_python()
    release = tmp_path / "release_root"
    release.mkdir()
    os.symlink(inputs["teacher"], release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    base = ["-m", "megatron_kd", "train", *COMMON[:COMMON.index("--train-iters")],
            "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "100", "--split",
            "90,5,5", "--data-path", inputs["data"], "--tokenizer-model", inputs["tokenizer"],
            "--no-progress", "--kd-ce-weight", "0.5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    want_log = str(tmp_path / "want.jsonl")
    _torchrun(sys.executable, 1, [*base, "--kd-teacher-load", inputs["teacher"], "--log-json",
                                  want_log], env)
    want = _megatron_kd_losses_only(want_log)
    assert len(want) == 3 and all(v["kd loss"] > 0 for v in want.values())
    for root in _checkouts():
        out = tmp_path / f"mlm_{os.path.basename(root)}"
        mlm_env = dict(env, CUDA_DEVICE_MAX_CONNECTIONS="1",
                       PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
                       PATH=os.pathsep.join([os.path.dirname(python), os.environ["PATH"]]))
        only = MEGATRON_LM_ONLY[MEGATRON_LM_ONLY.index("--tokenizer-type"):
                                MEGATRON_LM_ONLY.index("--save-interval")]
        # the patched script (as a user's), its KD term off: a plain LM step at learning rate 0
        _torchrun(python, 1, [LAUNCHER, _patched_script(root, tmp_path), *TEACHER_FLAGS,
                              "--kd-weight", "0", "--kd-ce-weight", "1",
                              *only,
                              "--seq-length", "32", "--micro-batch-size", "2",
                              "--global-batch-size", "2", "--train-iters", "1", "--lr", "0.0",
                              "--min-lr", "0.0", "--weight-decay", "0.0", "--clip-grad", "0.0",
                              "--eval-iters", "0", "--eval-interval", "100", "--split", "90,5,5",
                              "--data-path",
                              inputs["data"], "--load", str(release), "--finetune",
                              "--no-load-optim", "--no-load-rng", "--save", str(out),
                              "--save-interval", "1"], mlm_env)
        assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert not (out / "iter_0000001" / "model_config.json").exists()
        for extra in (["--kd-teacher-args", " ".join(TEACHER_FLAGS)], []):
            got_log = str(tmp_path / f"got_{os.path.basename(root)}_{len(extra)}.jsonl")
            _torchrun(sys.executable, 1, [*base, "--kd-teacher-load", str(out), *extra,
                                          "--log-json", got_log], env)
            assert _megatron_kd_losses_only(got_log) == want, (root, extra)


def _megatron_kd_losses_only(log_json):
    with open(log_json, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: {"total loss": r["loss"], "kd loss": r["kd_loss"]}
            for r in records if "step_time_s" in r}


MOE_STUDENT = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2"]


# Qwen3.5-MoE-shaped: layer 0 Gated DeltaNet, layer 1 gated attention with partial RoPE, a
# gated shared expert beside the routed ones
QWEN35_TEACHER = {"linear_attention_layers": [0], "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8, "attention_output_gate": True,
                  "rotary_percent": 0.25, "kv_channels": 16, "moe_shared_expert_size": 16,
                  "moe_shared_expert_gate": True}


@pytest.mark.parametrize("student, hybrid", [([], {}), (MOE_STUDENT, {}), ([], QWEN35_TEACHER)],
                         ids=["dense_student", "moe_student", "qwen35_moe_teacher"])
def test_real_pretrain_gpt_with_a_moe_teacher(inputs, tmp_path, dist_pool_factory, student,
                                              hybrid):
    """A mixture-of-experts teacher (4 experts, top 2, QK norms; or Qwen3.5-MoE-shaped, with
    a Gated DeltaNet layer) inside the real ``pretrain_gpt.py``, distilling into a dense
    student or one with experts of its own (Megatron-LM's flags, the same in ``megatron-kd
    train``): Megatron-LM's own megatron-core routes the tokens (the CPU shim's stand-ins on
    that version), and its per-iteration losses are ``megatron-kd train``'s, 1e-5 relative."""
    from support.train_cases import TEACHER_ARCH, case_make_teacher

    python = _megatron_lm_python()
    teacher = str(tmp_path / "moe_teacher")
    arch = dict(TEACHER_ARCH, init_method_std=0.25, num_experts=4, moe_ffn_hidden_size=24,
                moe_router_topk=2, qk_layernorm=True, **hybrid)
    dist_pool_factory(2).run(case_make_teacher, teacher, arch)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = str(tmp_path / "kd.jsonl")
    _torchrun(sys.executable, 1, ["-m", "megatron_kd", "train", *COMMON, *student, "--data-path",
                                  inputs["data"], "--tokenizer-model", inputs["tokenizer"],
                                  "--kd-teacher-load", teacher, "--log-json", log,
                                  "--no-progress"], env)
    want, _ = _megatron_kd_losses(log)
    assert all(v["kd loss"] > 0 for v in want.values())
    for root in _checkouts():
        mlm_env = dict(env, CUDA_DEVICE_MAX_CONNECTIONS="1",
                       PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
                       PATH=os.pathsep.join([os.path.dirname(python), os.environ["PATH"]]))
        out = _torchrun(python, 1, [LAUNCHER, _patched_script(root, tmp_path), *COMMON, *student,
                                    *MEGATRON_LM_ONLY, "--data-path", inputs["data"],
                                    "--kd-teacher-load", teacher], mlm_env)
        got, _ = megatron_lm_losses(out)
        assert sorted(got) == list(range(1, ITERS + 1)), (root, out[-3000:])
        for it in range(1, ITERS + 1):
            for key in KEYS:
                assert got[it][key] == pytest.approx(want[it][key], rel=1e-5), (root, it, key)


# --- several teachers: a weighted mixture ------------------------------------------------------
_TEACHER_VALUE = re.compile(r"kd loss teacher (\d+): ([0-9.E+-]+)")


def _megatron_lm_teacher_losses(log):
    """``{iteration: [teacher i's kd loss]}`` from Megatron-LM's log (iteration 2 undone as
    :func:`megatron_lm_losses` does)."""
    lines = {}
    for m in map(_LINE.search, log.splitlines()):
        if m:
            values = dict(_TEACHER_VALUE.findall(m.group(2)))
            lines[int(m.group(1))] = [float(values[str(i)]) for i in range(len(values))]
    if 1 in lines and 2 in lines:
        lines[2] = [2 * b - a for a, b in zip(lines[1], lines[2], strict=True)]
    return lines


def test_real_pretrain_gpt_two_teachers_match_megatron_kd_train(inputs, tmp_path,
                                                                dist_pool_factory):
    """Two colocated teachers (the tier's and a sharper one), weights 1 3, at TP 2 with
    ``--sequence-parallel`` inside the real ``pretrain_gpt.py``: every iteration's total, KD
    (the weighted sum) and LM loss and each teacher's own KD loss (``kd loss teacher <i>``)
    are ``megatron-kd train``'s same two-teacher run's, 1e-5 relative."""
    from support.train_cases import TEACHER_ARCH, case_make_teacher

    python = _megatron_lm_python()
    other = str(tmp_path / "other_teacher")
    # sharper than the tier's (std 0.25): its divergence differs by far more than the tolerance
    dist_pool_factory(2).run(case_make_teacher, other, dict(TEACHER_ARCH, init_method_std=0.5),
                             11)
    two = ["--kd-mode", "colocated", "colocated", "--kd-teacher-load", inputs["teacher"], other,
           "--kd-teacher-weights", "1", "3"]
    spec = LAYOUTS["tp2_sp"]
    log = str(tmp_path / "kd.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    _torchrun(sys.executable, spec.nproc, [
        "-m", "megatron_kd", "train", *COMMON, *spec.flags, "--data-path", inputs["data"],
        "--tokenizer-model", inputs["tokenizer"], *two, "--log-json", log, "--no-progress"], env)
    want = _megatron_kd_steps(log)
    with open(log, encoding="utf-8") as f:
        want_teachers = {r["step"]: r["teacher_kd_losses"] for r in map(json.loads, f)
                         if "step_time_s" in r}
    assert sorted(want) == list(range(1, ITERS + 1))
    for step, (kd0, kd1) in want_teachers.items():
        assert want[step]["kd loss"] == pytest.approx(0.25 * kd0 + 0.75 * kd1, rel=1e-6)
        assert kd0 != pytest.approx(kd1, rel=1e-3)  # two teachers, two divergences
    for root in _checkouts():
        out = _pretrain_gpt(python, root, tmp_path, spec.nproc, [
            *COMMON, *MEGATRON_LM_ONLY, *spec.flags, *spec.megatron_lm_flags,
            "--data-path", inputs["data"], *two])
        label = f"two teachers {_git(root, 'rev-parse', '--short', 'HEAD')}"
        got_steps, got_valid = megatron_lm_losses(out)
        _assert_steps_match(got_steps, want, label)
        got_teachers = _megatron_lm_teacher_losses(out)
        for it in range(1, ITERS + 1):
            print(f"{label} iteration {it}: kd loss teacher 0, 1 {got_teachers[it]} "
                  f"(megatron-kd train {want_teachers[it]})")
            assert got_teachers[it] == pytest.approx(want_teachers[it], rel=1e-5), (label, it)
        assert {"total loss", "kd loss", "lm loss"} <= set(got_valid), got_valid


# --- offline: a cache built by `megatron-kd cache build` inside pretrain_gpt.py -----------------
OFFLINE_LAYOUTS = {"dp2": Layout(2), "tp2": LAYOUTS["tp2"]}
CACHE_DATA = ["--split", "90,5,5", "--seed", "1234", "--eval-iters", "1"]


def _cache_build(inputs, out, data):
    """``megatron-kd cache build`` (TP 1, one process, K 16, lossless fp32 log-probs) of the
    run's samples (``ITERS`` steps of 4) over ``data`` (its data flags)."""
    from support.train_cases import cache_build_argv

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    _torchrun(sys.executable, 1, ["-m", "megatron_kd", *cache_build_argv(
        out, inputs["teacher"], topk=16, seq=32, iters=ITERS, global_batch=4, data=data)], env)
    return str(out)


@pytest.fixture(scope="module")
def offline_cache(inputs):
    """The cache of the run's own data: its data flags, as ``megatron-kd train`` takes them."""
    return _cache_build(inputs, inputs["dir"] / "topk_cache", [
        "--data-path", inputs["data"], "--tokenizer-model", inputs["tokenizer"], *CACHE_DATA])


def _megatron_kd_steps(log_json):
    """``{step: {total, kd, lm loss}}`` of a ``megatron-kd train --log-json`` file."""
    with open(log_json, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: {"total loss": r["loss"], "kd loss": r["kd_loss"],
                        "lm loss": r["lm_loss"]} for r in records if "step_time_s" in r}


@pytest.mark.parametrize("layout", list(OFFLINE_LAYOUTS))
def test_real_pretrain_gpt_offline_matches_megatron_kd_train(inputs, offline_cache, layout,
                                                             tmp_path):
    """``--kd-mode offline --kd-topk-cache DIR`` inside the real ``pretrain_gpt.py`` of each
    checkout, on a cache ``megatron-kd cache build`` made with the run's data flags: every
    iteration's total, KD and LM losses are ``megatron-kd train --kd-mode offline``'s on the
    same cache, 1e-5 relative (Megatron-LM's rows found by their tokens, ours by sample
    index); its evaluation has no teacher (the cache holds training samples only)."""
    python = _megatron_lm_python()
    spec = OFFLINE_LAYOUTS[layout]
    offline = ["--kd-mode", "offline", "--kd-topk-cache", offline_cache]
    log = str(tmp_path / "kd.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    _torchrun(sys.executable, spec.nproc, [
        "-m", "megatron_kd", "train", *COMMON, *spec.flags, "--data-path", inputs["data"],
        "--tokenizer-model", inputs["tokenizer"], *offline, "--log-json", log, "--no-progress"],
        env)
    want = _megatron_kd_steps(log)
    assert sorted(want) == list(range(1, ITERS + 1))
    assert all(v["kd loss"] > 0 for v in want.values())
    for root in _checkouts():
        out = _pretrain_gpt(python, root, tmp_path, spec.nproc, [
            *COMMON, *MEGATRON_LM_ONLY, *spec.flags, "--data-path", inputs["data"], *offline])
        got_steps, got_valid = megatron_lm_losses(out)
        _assert_steps_match(got_steps, want,
                            f"offline {layout} {_git(root, 'rev-parse', '--short', 'HEAD')}")
        assert set(got_valid) == {"total loss", "lm loss"}, got_valid


def test_real_pretrain_gpt_offline_cache_for_other_data_refused(inputs, tmp_path):
    """A cache built for other data (``--mock-data``, the same sizes) stops ``pretrain_gpt.py``
    before its first iteration, naming the first sample (step 1, microbatch 0, sample 0 of
    data-parallel rank 0) and the cache."""
    python = _megatron_lm_python()
    other = _cache_build(inputs, tmp_path / "other_cache", ["--mock-data", *CACHE_DATA])
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    for root in _checkouts():
        run_env = dict(env, PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
                       PATH=os.pathsep.join([os.path.dirname(python), os.environ["PATH"]]))
        proc = subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", LAUNCHER,
                               _patched_script(root, tmp_path), *COMMON, *MEGATRON_LM_ONLY,
                               "--data-path", inputs["data"], "--kd-mode", "offline",
                               "--kd-topk-cache", other], capture_output=True, text=True,
                              env=run_env, timeout=600, check=False)
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0, log[-3000:]
        assert ("ValueError: sample 0 of microbatch 0 of step 1 (counted from the run's start) "
                f"on data-parallel rank 0: the top-K cache {other} holds no sample with its "
                f"tokens") in log, (root, log[-6000:])
        assert not _LINE.search(log), (root, "an iteration ran")
