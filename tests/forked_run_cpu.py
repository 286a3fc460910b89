"""CPU seconds of a script run forked from the test zygote's state (tests/zygote.preload, then its
heap.freeze_heap), as tests/launch.run runs a one-rank launch: the child's own rusage (os.wait4), so the
preload is not counted. Prints one JSON line per repeat.

  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29700 \\
  .venv/bin/python tests/forked_run_cpu.py [--no-freeze] [--repeats N] SCRIPT ARGS...

"{repeat}" in ARGS becomes the repeat's number (a run_dir of its own for a training run)."""

import argparse
import json
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-freeze", action="store_true", help="leave the imports' objects collectable")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import zygote

    from megarl.platform import heap

    zygote.preload()
    if not options.no_freeze:  # as tests/zygote.py's main does
        heap.freeze_heap()
    for repeat in range(options.repeats):
        started = time.time()
        pid = os.fork()
        if pid == 0:
            sys.argv = [options.script, *(arg.replace("{repeat}", str(repeat)) for arg in options.args)]
            sys.path[0] = os.path.dirname(os.path.abspath(options.script))
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            code = 0
            try:
                runpy.run_path(options.script, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"frozen": not options.no_freeze, "status": status,
                          "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                          "wall_s": round(time.time() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
