"""A tool worker process (the agent loop's pool starts it):
`python -m megarl.rollout.agent.tool_worker IN_FD OUT_FD [TOOL ...]`: loads the tools, then answers
(index, tool key, arguments) jobs with (index, text or None, error or None)
(megarl/plugins/worker_pool.py)."""

import sys

from megarl.plugins.worker_pool import serve
from megarl.rollout.agent.tools import loaded_tools

if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), loaded_tools(), sys.argv[3:])
