"""A scoring worker process (pool.py starts it):
`python -m megarl.rewards.worker IN_FD OUT_FD [FUNCTION ...]`.

Loads the named functions (their modules' imports, e.g. torch, can take seconds) before it says
it is ready, so a job's timeout never counts the start; then answers (index, function name,
Request) jobs with (index, Outcome or None, error or None); loads each function once. Imports no
torch: it starts in a moment.
"""

import sys

from megarl.plugins.worker_pool import serve
from megarl.rewards.functions import loaded_functions

if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), loaded_functions(), sys.argv[3:])
