"""Main job on the reference backend: kept for ``python -m attn_reference.demo``.

The logic lives in ``attn_common.cli`` (the ``attn`` command); this runs
``attn run all --implementation reference`` with any extra arguments
(``--batch``, ``--seed``, ``--small``).
"""

from __future__ import annotations

import sys

from attn_common.cli import main as _attn_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return _attn_main(["run", "all", "--implementation", "reference", *argv])


if __name__ == "__main__":
    sys.exit(main())
