"""Write ``examples/megatron_lm/model_args/<preset>.txt``: the Megatron-LM model flags of each
planner preset that Megatron-LM's GPT flags can express (the Llama and Qwen3 families), for
``examples/megatron_lm/train_kd_*.sh``'s ``MODEL_ARGS_FILE`` and ``--kd-teacher-args``.
``tests/unit/test_megatron_lm_flags.py`` checks the shipped files equal what this writes.

    python tools/write_model_args.py            # rewrite them
    python tools/write_model_args.py --check    # exit 1 naming any file that differs
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_kd.arch.megatron_lm_args import megatron_lm_flags_text
from megatron_kd.planner.presets import MODEL_PRESETS

DIRECTORY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "examples", "megatron_lm", "model_args")


def expected() -> dict[str, str]:
    """``{file name: text}`` for every preset the flags can express."""
    out = {}
    for name, model in sorted(MODEL_PRESETS.items()):
        try:
            out[f"{name}.txt"] = megatron_lm_flags_text(
                model.arch, f"{name} (megatron-kd plan's preset: {model.source}); "
                            f"written by tools/write_model_args.py")
        except ValueError:
            continue  # a hybrid or gpt-oss: `megatron-kd train` only
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    differ = []
    for name, text in expected().items():
        path = os.path.join(DIRECTORY, name)
        if a.check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        differ.append(path)
            except FileNotFoundError:
                differ.append(path)
        else:
            os.makedirs(DIRECTORY, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(path)
    if differ:
        print("differ from the presets (run tools/write_model_args.py):", *differ, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
