"""The pretrain_gpt.py hooks' old path, ``megatron_kd.integration.megatron_lm``, kept for one
release: a tree patched before they moved to :mod:`megatron_kd.megatron_lm` still gets every
entry point, and a ``DeprecationWarning`` naming the new path."""

import sys
import warnings

import pytest

import megatron_kd.megatron_lm as hooks

OLD = "megatron_kd.integration.megatron_lm"


@pytest.fixture
def fresh_alias(monkeypatch):
    # the warning comes once per import: drop a copy an earlier test may have imported
    monkeypatch.delitem(sys.modules, OLD, raising=False)


def test_old_path_warns_naming_the_new_one(fresh_alias):
    with pytest.warns(DeprecationWarning, match=r"import megatron_kd\.megatron_lm\b") as seen:
        import megatron_kd.integration.megatron_lm  # noqa: F401
    # shown where it is imported (a patched pretrain_gpt.py is __main__: Python's default
    # filters show deprecations attributed there)
    assert [w.filename for w in seen if w.category is DeprecationWarning] == [__file__]


def test_old_path_re_exports_the_hooks(fresh_alias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import megatron_kd.integration.megatron_lm as old
    assert old.__all__ == hooks.__all__
    for name in hooks.__all__:
        assert getattr(old, name) is getattr(hooks, name), name
