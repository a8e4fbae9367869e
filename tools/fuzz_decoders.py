"""Coverage-guided fuzzing of the decoders (cache manifest, cache shard, sample blob, wire
header) with atheris; see :mod:`megatron_kd.testing.fuzz` for what each target checks.

    python tools/fuzz_decoders.py --target shard --runs 200000 --corpus fuzz_corpus/shard

Each target runs in a process of its own (libFuzzer ends the process when it is done). An input
that breaks a target is written as ``<corpus>/crash-*``: copy it to ``tests/data/fuzz/<target>/``
so the test suite replays it for ever. Prints one JSON line per target with the inputs run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from megatron_kd.testing.fuzz import TARGETS, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS) + ["all"], default="all")
    parser.add_argument("--runs", type=int, default=100_000, help="inputs per target")
    parser.add_argument("--corpus", default="fuzz_corpus", help="corpus directory (per target "
                                                                 "a subdirectory with --target all)")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:  # one target, in this process
        run(args.target, args.runs, args.corpus)
        return 0
    targets = sorted(TARGETS) if args.target == "all" else [args.target]
    failed = 0
    for target in targets:
        corpus = os.path.join(args.corpus, target) if args.target == "all" else args.corpus
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--_child", "--target", target,
                               "--runs", str(args.runs), "--corpus", corpus],
                              capture_output=True, text=True)
        done = re.findall(r"Done (\d+) runs", proc.stderr)
        crashes = sorted(n for n in os.listdir(corpus) if n.startswith("crash-")) \
            if os.path.isdir(corpus) else []
        print(json.dumps({"target": target, "runs": int(done[-1]) if done else None,
                          "seconds": round(time.perf_counter() - t0, 1),
                          "exit_code": proc.returncode, "crashes": crashes}), flush=True)
        if proc.returncode != 0 or crashes:
            failed += 1
            sys.stderr.write(proc.stderr[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
