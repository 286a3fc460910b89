"""The remote sandbox (`generation.agent.sandbox: http`): a client of SandboxFusion's run_code API,
the server verl's code tools and rewards call, so that the model's code runs on another machine.

A call POSTs {"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB",
"stdin": "", "files": {}, "fetch_files": []} to the endpoint (e.g. http://host:8080/run_code) and
reads {"status": "Success" | "Failed" | "SandboxError", "message", "run_result": {"status":
"Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr"}}. A request that
gets no answer (refused, reset, past `timeout_s`) or a 502, 503 or 504 is sent again, up to
`retries` more times, a moment apart; then the call fails with an error naming the endpoint, the
attempts and each failure: a sandbox that is down fails the tool call visibly, within
(retries + 1) x (timeout_s + backoff). Any other answer that is not a run (4xx, SandboxError, not
JSON) fails it at once. Does not own what the server isolates, or the local sandbox (sandbox.py).
"""

import http.client
import json
import time
import urllib.error
import urllib.request

from megarl.rollout.agent.sandbox import Limits, Ran

RETRIED_STATUS = (502, 503, 504)  # a gateway or a server that is (re)starting
BACKOFF_S = 0.2  # before the n-th retry, n times this


def request_body(code: str, limits: Limits) -> bytes:
    """The run_code request: the program's wall clock and memory are the local sandbox's limits."""
    return json.dumps({"code": code, "language": "python", "run_timeout": limits.wall_s,
                       "compile_timeout": limits.wall_s, "memory_limit_MB": limits.memory_bytes >> 20,
                       "stdin": "", "files": {}, "fetch_files": []}).encode()


def run_http(code: str, url: str, timeout_s: float, retries: int, limits: Limits) -> Ran:
    """Run `code` on the SandboxFusion server at `url` and return what it did."""
    body = request_body(code, limits)
    failures = []
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(BACKOFF_S * attempt)
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            if error.code not in RETRIED_STATUS:
                raise RuntimeError(f"the sandbox at {url} answered HTTP {error.code}: "
                                   f"{error.read()[:300].decode(errors='replace')}") from None
            failures.append(f"HTTP {error.code}")
            continue
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out
            failures.append(f"{type(error).__name__}: {getattr(error, 'reason', error)}")
            continue
        return _ran(text, url, limits)
    raise RuntimeError(f"the sandbox at {url} did not answer: {retries + 1} attempts of {timeout_s:g} s "
                       f"each failed ({'; '.join(failures)}); is it running? (generation.agent.sandbox_url)")


def _ran(text: bytes, url: str, limits: Limits) -> Ran:
    try:
        answer = json.loads(text)
    except ValueError:
        raise RuntimeError(f"the sandbox at {url} answered {text[:200]!r}, not run_code's JSON") from None
    result = answer.get("run_result") if isinstance(answer, dict) else None
    if answer.get("status") == "SandboxError" or not isinstance(result, dict):
        raise RuntimeError(f"the sandbox at {url} could not run the code: status {answer.get('status')!r}, "
                           f"{answer.get('message') or 'no run_result'}")
    streams = [result.get("stdout") or "", result.get("stderr") or ""]
    cut = any(len(stream) > limits.output_bytes for stream in streams)
    stdout, stderr = (stream[:limits.output_bytes] for stream in streams)
    if result.get("status") == "TimeLimitExceeded":
        return Ran(stdout, stderr, None, cut)
    return Ran(stdout, stderr, int(result.get("return_code") or 0), cut)
