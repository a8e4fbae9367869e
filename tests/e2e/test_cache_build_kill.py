"""A cache build subprocess killed with SIGKILL mid-build, then started again: the resumed cache
is byte-identical to an uninterrupted build."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.cache_cases import TinyTeacher, cache_files, cache_spec

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.format import load_manifest

_BUILD_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from support.cache_cases import TinyTeacher, cache_spec
from megatron_kd.cache.build import build_cache
teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12, delay={delay})
spec = cache_spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
build_cache({out!r}, spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens, output_weight=teacher.output)
print("done")
"""


def _run_build(out, delay):
    script = _BUILD_SCRIPT.format(tests=str(Path(__file__).parents[1]), out=str(out), delay=delay)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigkill_mid_build_then_resume_is_byte_identical(tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12)
    spec = cache_spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
    build_cache(str(tmp_path / "ref"), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output)
    ref = cache_files(tmp_path / "ref")

    out = tmp_path / "killed"
    proc = _run_build(out, delay=0.25)  # >= 0.5 s per shard of 2 samples: 3 s of margin to kill
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "manifest.json").exists() and len(load_manifest(out)["shards"]) >= 2:
            break
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.5))  # somewhere inside a later shard
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    partial = len(load_manifest(out)["shards"])
    assert 2 <= partial < spec.num_shards, partial

    proc = _run_build(out, delay=0.0)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()
    assert cache_files(out) == ref
    assert not [p for p in out.iterdir() if ".tmp." in p.name]
