"""Conformance tests: make the shared helpers (``oracle``, ``helpers``) importable.

pytest runs with ``--import-mode=importlib``, which does not put test directories on
``sys.path``; the helper modules live next to the tests.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
