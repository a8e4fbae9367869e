"""``megatron-kd cache``: build, verify and describe offline top-K teacher caches.

::

    megatron-kd cache build --out DIR --kd-teacher-load CKPT --kd-topk 100 \\
        --seq-length 4096 --micro-batch-size 4 --train-iters 1000 --global-batch-size 256 \\
        --data-path PREFIX --tokenizer-model tokenizer.json [--tensor-model-parallel-size 8]
    megatron-kd cache verify DIR        # every checksum; exit 1 naming shard + sample range
    megatron-kd cache info DIR          # spec, progress, bytes per token

``build`` takes the training run's data flags (``--data-path --split --seed --seq-length
--train-iters --global-batch-size --eval-iters``, or ``--mock-data``: the run's own
:class:`~megatron_kd.training.run_config.DataSection`) and checks them, and the teacher, with the
trainer's own checks (:mod:`megatron_kd.training.run_checks`), so it builds the very
``GPTDataset`` the student will read, and caches samples ``[0, train_iters x
global_batch_size)``. Launch it with ``torchrun``: the world splits into teacher replicas of
``--tensor-model-parallel-size`` ranks; replicas share the shards. Run it again after a crash
to resume. The teacher is not pipelined.

The build itself is :mod:`megatron_kd.commands.cache_build`, imported only for ``build``:
``verify`` and ``info`` read files and answer without torch or Megatron-Core.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_kd.cache.summary import print_info, print_verify
from megatron_kd.flags import KDSharedFlags, add_flags, flag, from_flags, shared_flag

__all__ = ["CacheBuildSection", "add_arguments", "run"]


@dataclass(frozen=True, kw_only=True)
class CacheBuildSection:
    """What ``cache build`` asks beyond the run's data, parallelism and teacher flags."""

    out: str = flag(help="cache directory (resumed)", metavar="DIR")
    topk: int = shared_flag(KDSharedFlags, "topk")
    logprob_encoding: str = flag("log1p-u11", "'log1p-u<bits>' (compact, default 11 bits) or "
                                              "'fp32' (lossless)")
    samples_per_shard: int = flag(128)
    window_size: int = flag(1024, "rows projected onto the vocabulary at once")
    micro_batch_size: int = flag(1, "samples per teacher call")


class _FlagsOnUse(argparse.ArgumentParser):
    """A sub-command's parser whose flags are added the first time it parses or prints: those
    of ``cache build`` come from the run's sections (Megatron-Core's configs, seconds to
    import), which ``verify`` and ``info`` never need."""

    def __init__(self, *args, add_flags_to=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._add_flags_to = add_flags_to

    def _ready(self) -> None:
        if self._add_flags_to is not None:
            add, self._add_flags_to = self._add_flags_to, None
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ready()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._ready()
        return super().format_usage()

    def format_help(self) -> str:
        self._ready()
        return super().format_help()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                parser_class=_FlagsOnUse)
    v = sub.add_parser("verify", help="check every shard's checksum")
    v.add_argument("dir")
    i = sub.add_parser("info", help="print the manifest summary")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("build", help="run the teacher over the training samples, store top-K",
                   add_flags_to=_add_build_flags)


def _add_build_flags(b: argparse.ArgumentParser) -> None:
    # the run's sections are Megatron-Core's configs: imported for build only
    from megatron_kd.commands.cache_build import add_data_flags, add_run_flags

    add_flags(b, CacheBuildSection, exclude=("micro_batch_size",))
    add_run_flags(b)
    add_flags(b, CacheBuildSection, only=("micro_batch_size",))
    add_data_flags(b)


def run(args: argparse.Namespace) -> int:
    if args.action == "verify":
        return print_verify(args.dir)
    if args.action == "info":
        return print_info(args.dir, as_json=args.json)
    return _build(args)


def _build(args: argparse.Namespace) -> int:
    # torch and Megatron-Core: imported for build only
    from megatron_kd.commands.cache_build import run_build

    return run_build(from_flags(CacheBuildSection, args), args)
