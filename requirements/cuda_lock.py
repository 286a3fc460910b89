"""The GPU lock (requirements/cuda-lock.txt) from pip's resolution, and the check that PyPI still
resolves it to exactly those versions.

pip cannot resolve the GPU install on a machine without CUDA torch: transformer_engine_torch is
a source package whose build reads torch.version.cuda. So the lock is resolved as
`.[cuda,dev]` plus transformer_engine_torch's own requirements (`make lock-cuda`), and the
transformer_engine_torch line, which `make install DEVICE=cuda` builds in a second step, is added
at the core's version.

  python requirements/cuda_lock.py write REPORT.json > requirements/cuda-lock.txt
  python requirements/cuda_lock.py check REPORT.json requirements/cuda-lock.txt
"""

import json
import re
import sys
from typing import Dict, List

HEADER = """\
# Exact versions of every package of the GPU install (make install DEVICE=cuda), resolved on
# Python 3.11 x86_64 from PyPI: torch's CUDA 13.0 build, CUDA vLLM, Transformer Engine 2.11 (CUDA
# 13 core). Regenerate: make lock-cuda (after changing setup.py); check: make check-cuda-lock.
# torch is pinned with === : a local CPU build (2.13.0+cpu) satisfies ==2.13.0, and pip prefers it
# when a find-links folder or mirror offers it; === admits only the release itself.
"""
# Built against the installed torch after everything else (TE's documented install); its
# requirements are in the lock, resolved beside the rest.
TE_TORCH = "transformer_engine_torch"
TE_CORE = "transformer_engine_cu13"
EXACT = {"torch"}  # pinned with ===, see HEADER


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report: dict) -> Dict[str, str]:
    """pip's --report JSON -> {canonical name: version}, without editable installs (megarl)."""
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"]
            for item in report["install"] if not item.get("is_direct") or not
            item["download_info"].get("dir_info", {}).get("editable")}


def lock_text(versions: Dict[str, str]) -> str:
    if canonical(TE_CORE) not in versions:
        raise ValueError(f"{TE_CORE} is not in the resolution: resolve '.[cuda,dev]'")
    versions = {**versions, canonical(TE_TORCH): versions[canonical(TE_CORE)]}
    lines = [f"{name}{'===' if name in EXACT else '=='}{version}"
             for name, version in sorted(versions.items())]
    return HEADER + "\n".join(lines) + "\n"


def parse_lock(text: str) -> Dict[str, str]:
    """{canonical name: version} of a lock's `name==version` / `name===version` lines."""
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(===|==)([^\s;]+)", line)
        if not match:
            raise ValueError(f"lock line {number}: {line!r} is not an exact pin (name==version)")
        pins[canonical(match.group(1))] = match.group(3)
    return pins


def differences(lock: Dict[str, str], versions: Dict[str, str]) -> List[str]:
    """What pip resolved that the lock does not say, and the reverse (transformer_engine_torch is
    built, not resolved: it is checked against the core's version instead)."""
    lock = dict(lock)
    te_torch = lock.pop(canonical(TE_TORCH), None)
    problems = [f"{name}: lock {lock.get(name)}, resolved {versions.get(name)}"
                for name in sorted(set(lock) | set(versions)) if lock.get(name) != versions.get(name)]
    if te_torch != lock.get(canonical(TE_CORE)):
        problems.append(f"{TE_TORCH} {te_torch} differs from {TE_CORE} {lock.get(canonical(TE_CORE))}")
    return problems


def main(argv: List[str]) -> int:
    command, report_path = argv[0], argv[1]
    with open(report_path) as f:
        versions = resolved(json.load(f))
    if command == "write":
        sys.stdout.write(lock_text(versions))
        return 0
    with open(argv[2]) as f:
        problems = differences(parse_lock(f.read()), versions)
    for problem in problems:
        print(f"cuda lock: {problem}", file=sys.stderr)
    print(json.dumps({"packages": len(versions), "resolved_as_locked": not problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
