"""A cache build on a full disk: the shard it was writing fails with an error naming the path and
the bytes it needs, nothing already written changes, and once space is freed the build resumes
to a byte-identical cache. First with a writer that fails with ENOSPC (any machine), then on a
real 64 KiB tmpfs where the machine lets us mount one.
"""

import builtins
import errno
import shutil
import subprocess

import pytest
from support.cache_cases import TinyTeacher, cache_files, cache_spec

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.format import CacheWriteError, load_manifest, verify


def _teacher_and_spec():
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=16)
    return teacher, cache_spec(teacher, num_samples=8, topk=25, samples_per_shard=2,
                               codec="log1p-u11")


def _build(path, teacher, spec):
    return build_cache(str(path), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens, output_weight=teacher.output)


def test_enospc_names_path_and_bytes_then_resumes_identically(tmp_path, monkeypatch):
    teacher, spec = _teacher_and_spec()
    _build(tmp_path / "ref", teacher, spec)
    out = tmp_path / "cache"
    full_after = spec.shard_file(2)  # shards 0 and 1 fit, the third does not
    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        if "w" in mode and full_after in str(file):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(CacheWriteError) as err:
        _build(out, teacher, spec)
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert f"could not write {out / full_after}: no space left on device" in message
    assert "it needs " in message and "bytes" in message
    assert [s["file"] for s in load_manifest(out)["shards"]] == [spec.shard_file(0),
                                                                 spec.shard_file(1)]
    assert verify(out) == [f"{spec.shard_file(i)} (samples [{2 * i}, {2 * i + 2})): not built"
                           for i in (2, 3)]  # the two complete shards verify clean
    assert not [p for p in out.iterdir() if ".tmp." in p.name]  # no temp file left behind
    monkeypatch.setattr(builtins, "open", real_open)  # space freed
    stats = _build(out, teacher, spec)
    assert stats.shards_skipped == [0, 1] and stats.shards_written == [2, 3]
    assert cache_files(out) == cache_files(tmp_path / "ref")


def _mount_tmpfs(path, size):
    if shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return proc.returncode == 0


def test_real_full_tmpfs(tmp_path):
    teacher, spec = _teacher_and_spec()
    _build(tmp_path / "ref", teacher, spec)
    mount = tmp_path / "small"
    mount.mkdir()
    if not _mount_tmpfs(mount, "8k"):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        with pytest.raises(CacheWriteError, match="no space left on device") as err:
            _build(mount / "cache", teacher, spec)
        assert err.value.errno == errno.ENOSPC
        built = len(load_manifest(mount / "cache")["shards"]) if (
            mount / "cache" / "manifest.json").exists() else 0
        assert built < spec.num_shards
        subprocess.run(["mount", "-o", "remount,size=4m", str(mount)], check=True)
        _build(mount / "cache", teacher, spec)
        assert cache_files(mount / "cache") == cache_files(tmp_path / "ref")
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
