"""``python -m megatron_kd.testing.simulated COMMAND [ARGS...]``: ``megatron-kd COMMAND``
inside the simulated accelerator (:mod:`megatron_kd.testing.devices`), for tests (not for users).

The CPU tests run a command's GPU placement this way where the command is a process of its own
(a ``teacher serve`` replica under torchrun): every model must be moved to the "GPU", and an op
mixing host and accelerator tensors, or a collective given a host tensor, fails the command.
"""

from __future__ import annotations

import sys

from megatron_kd.cli import main as cli_main
from megatron_kd.testing.devices import simulated_accelerator

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    with simulated_accelerator():
        return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
