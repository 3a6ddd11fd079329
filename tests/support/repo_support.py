"""Where things are, for the tests in every folder (no tests here): the repository root, the test tree, this support
folder, and the environment a subprocess needs to import the support modules."""

from __future__ import annotations

import os
from pathlib import Path

#: the support folder (``tests/support/``): the ``*_support`` modules, ``fed_tiny``, ``tiny_models``...; on ``sys.path``
#: (pytest's ``pythonpath`` setting) for the pytest process
SUPPORT = Path(__file__).resolve().parent
#: the test tree, laid out like the code
TESTS = SUPPORT.parent
#: the repository root
ROOT = TESTS.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


def subprocess_env(*front: str | os.PathLike[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with ``PYTHONPATH`` = ``front`` + the support folder + the inherited value:
    what a child Python (a SuperNode, a torchrun rank, ``python -c``) needs to import the support modules."""
    env = dict(os.environ if base is None else base)
    parts = [*map(str, front), str(SUPPORT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env
