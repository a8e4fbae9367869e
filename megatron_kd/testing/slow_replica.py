"""A teacher replica whose forward also sleeps, for benchmarks and tests (not for users).

``python -m megatron_kd.testing.slow_replica SECONDS_PER_TOKEN -- <teacher serve flags>`` runs
``megatron-kd teacher serve`` whose forward sleeps ``SECONDS_PER_TOKEN`` x the batch's tokens
after computing: a teacher on an accelerator of its own, seen from a machine whose cores are
shared, or a deliberately slow teacher.
"""

from __future__ import annotations

import sys
import time

import torch

from megatron_kd.cli import main as cli_main
from megatron_kd.commands import teacher_serve

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m megatron_kd.testing.slow_replica SECONDS_PER_TOKEN -- "
              "<teacher serve flags>", file=sys.stderr)
        return 2
    seconds_per_token = float(argv[0])
    torch.set_num_threads(1)
    if seconds_per_token > 0:
        make = teacher_serve.full_sequence_forward

        def forward_fn(model, **kwargs):
            inner = make(model, **kwargs)

            def forward(tokens):
                out = inner(tokens)
                time.sleep(seconds_per_token * tokens.numel())
                return out

            return forward

        teacher_serve.full_sequence_forward = forward_fn
    return cli_main(["teacher", "serve", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
