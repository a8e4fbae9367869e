"""Deprecated: the ``pretrain_gpt.py`` hooks moved to :mod:`megatron_kd.megatron_lm`.

Kept for one release so that a Megatron-LM tree patched before the move (``import
megatron_kd.integration.megatron_lm as kd_lm``) still runs; importing it warns. Re-apply the
patch in ``patches/`` (``git checkout pretrain_gpt.py``, then ``git apply``).
"""

import warnings

# stacklevel 2: the line that imports this module (warnings skips importlib's own frames), so
# a patched pretrain_gpt.py run as __main__ shows it under Python's default filters
warnings.warn("megatron_kd.integration.megatron_lm is deprecated and will be removed in the "
              "next release: import megatron_kd.megatron_lm (the patches in patches/ do)",
              DeprecationWarning, stacklevel=2)

from megatron_kd.megatron_lm import *  # noqa: E402,F403  (the hooks' public names)
from megatron_kd.megatron_lm import __all__  # noqa: E402,F401
