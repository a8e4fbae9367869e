"""A cache build subprocess killed with SIGKILL mid-build (parked in a shard's forward by a held
file), then started again: the resumed cache is byte-identical to an uninterrupted build."""

import os
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
teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12, hold={hold!r})
spec = cache_spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
build_cache({out!r}, spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens, output_weight=teacher.output)
print("done")
"""


def _run_build(out, hold=None):
    script = _BUILD_SCRIPT.format(tests=str(Path(__file__).parents[1]), out=str(out), hold=hold)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigkill_mid_build_then_resume_is_byte_identical(tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12)
    spec = cache_spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
    build_cache(str(tmp_path / "ref"), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output)
    ref = cache_files(tmp_path / "ref")

    out, hold = tmp_path / "killed", tmp_path / "hold"
    hold.touch()
    # parked in the forward of sample 7, the second of shard 3 (micro-batches of 1): shards
    # 0-2 written, shard 3 half computed; killed there, not after a guessed time
    proc = _run_build(out, hold=(str(hold), 7))
    deadline = time.monotonic() + 300
    while not Path(f"{hold}.reached").exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the build never reached sample 7"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    hold.unlink()
    assert [e["file"] for e in load_manifest(out)["shards"]] == [spec.shard_file(i)
                                                                 for i in range(3)]

    proc = _run_build(out)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()
    assert cache_files(out) == ref
    assert not [p for p in out.iterdir() if ".tmp." in p.name]
