"""``python -m megatron_kd`` is the same as the ``megatron-kd`` console script."""

import sys

from megatron_kd.cli import main

if __name__ == "__main__":
    sys.exit(main())
