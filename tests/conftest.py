"""Shared pytest setup. Append only (several modules' tests share this file)."""

import sys
from pathlib import Path

# Make `import kimi` work under plain `pytest` without installing the package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
