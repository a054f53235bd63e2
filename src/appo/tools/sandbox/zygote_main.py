"""The script the sandbox zygote runs: `python -I -B zygote_main.py FD CONFIG` (started by
`appo.tools.sandbox.host.Sandbox`; FD is its control socket, CONFIG the JSON config).

`-I` keeps the script's directory, PYTHONPATH and the user site off `sys.path`, so the zygote
(and the code it runs) sees only the interpreter's own paths. `appo` itself is therefore not
importable here, or would resolve to whatever copy site-packages holds. So this script
registers its own directory as the package `appo.tools.sandbox` without running the package's
`__init__` (the host side: subprocess, threading, ...) and imports the zygote from it; the
worker-side modules import only the standard library and each other, relatively.
"""

from __future__ import annotations

import os
import sys
import types

PACKAGE = "appo.tools.sandbox"


def _register_package() -> None:
    """Make `appo.tools.sandbox.<module>` importable from this directory alone: a
    submodule import only looks its parent up in `sys.modules` and searches its `__path__`."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    package.__package__ = PACKAGE
    sys.modules[PACKAGE] = package


if __name__ == "__main__":
    _register_package()
    from appo.tools.sandbox.zygote import main

    main()
