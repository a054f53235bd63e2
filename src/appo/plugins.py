"""`--plugin MODULE|FILE.py`: import a user's code before the config is validated, so the
strategies (and other implementations) it registers are valid config values.

A plugin is an ordinary Python module that calls `appo.register_strategy(...)` (or another
`register_*`) when imported. It is named as a module (`my_plugins.branching`, found on
`sys.path`, to which the working directory is added as `python -m` would) or as a path to a
`.py` file. Every failure is one line naming the plugin: a missing file or module, an
exception while importing it (its type and message), a registration refused (e.g. a
built-in's name). Each process of a distributed run loads the same plugins, since each
parses the same command line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from appo.errors import AppoError


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def _import_file(path: Path) -> ModuleType:
    resolved = path.resolve()
    # One module per file, named by its path, so the same file loaded twice is one module.
    name = "appo_plugin_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise AppoError("not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import leaves nothing half-registered as imported
        raise
    return module


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin (a module name or a `.py` path); errors as one `AppoError` line."""
    spec = str(spec).strip()
    if not spec:
        raise AppoError("--plugin: empty name (give a module name or a .py file)")
    try:
        if _is_file_spec(spec):
            path = Path(spec).expanduser()
            if not path.is_file():
                raise AppoError(f"--plugin {spec}: file not found")
            return _import_file(path)
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)  # `--plugin my_module` finds ./my_module.py
        try:
            return importlib.import_module(spec)
        except ModuleNotFoundError as e:
            if e.name and (spec == e.name or spec.startswith(e.name + ".")):
                raise AppoError(f"--plugin {spec}: no module named {e.name!r} (give a module "
                                "on the Python path, or a path to a .py file)") from None
            raise
    except AppoError as e:
        text = str(e)
        raise AppoError(text if text.startswith("--plugin") else f"--plugin {spec}: {text}"
                        ) from None
    except SyntaxError as e:
        raise AppoError(f"--plugin {spec}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}"
                        ) from None
    except Exception as e:  # noqa: BLE001 - whatever the user's module raised on import
        first = (str(e) or "").splitlines()[0] if str(e) else ""
        raise AppoError(f"--plugin {spec}: importing it failed: {type(e).__name__}"
                        + (f": {first}" if first else "")) from None


def load_plugins(specs: list[str] | None) -> list[ModuleType]:
    """Import every plugin, in order."""
    return [load_plugin(s) for s in specs or []]
