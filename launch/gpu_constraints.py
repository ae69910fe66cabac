"""Print the pins for a virtual environment that shares a GPU machine's preinstalled packages (launch/setup.sh):

- torch, triton and transformers at the preinstalled versions: the machine's CUDA builds are never replaced;
- the lock file's pin for every package the machine lacks;
- no pin for the other preinstalled packages: pip keeps them where they meet the requirements.

Run it with the interpreter the venv is made from, so that it sees only the machine's packages:
    python3 launch/gpu_constraints.py constraints.txt > .venv/constraints.txt
"""

import re
import sys
from importlib import metadata

KEPT_AS_INSTALLED = ("torch", "triton", "transformers")


def canonical(name: str) -> str:
    """The name pip compares (PEP 503): case and runs of -, _ and . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def preinstalled() -> dict[str, str]:
    found = {}
    for distribution in metadata.distributions():
        name = distribution.metadata["Name"]
        if name:
            found.setdefault(canonical(name), distribution.version)  # the first on sys.path is the one imported
    return found


def pins(lock_lines: list[str], installed: dict[str, str]) -> list[str]:
    kept = [f"{name}=={installed[name]}" for name in KEPT_AS_INSTALLED if name in installed]
    added = []
    for line in lock_lines:
        requirement = line.split("#")[0].strip()
        if requirement and canonical(re.split(r"[\s=<>!~;\[]", requirement)[0]) not in installed:
            added.append(requirement)
    return kept + added


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} LOCK_FILE", file=sys.stderr)
        return 2
    with open(argv[1]) as lock:
        print("\n".join(pins(lock.read().splitlines(), preinstalled())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
