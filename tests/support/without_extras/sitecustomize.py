"""Imported at start-up from PYTHONPATH: the modules WITHOUT_EXTRAS_BLOCKED names cannot be
imported, as in an install of the package without its extras (tests/support/plain_install.py).

None in sys.modules is the import system's own "absent": `import` raises
ModuleNotFoundError and importlib.util.find_spec answers None, so code that probes
for an optional module takes the path it takes when the module is not installed.
"""

from __future__ import annotations

import os
import sys

for _name in filter(None, os.environ.get("WITHOUT_EXTRAS_BLOCKED", "").split(",")):
    sys.modules[_name] = None  # type: ignore[assignment]
