"""Build tools from config: `tools.tool_instances.<name>.{class_path, params}`.

`class_path` is any importable class (users add their own tools this way); `params` are its
constructor keyword arguments. The instance name becomes the tool's name and, unless
`params.tag` says otherwise, its trigger tag. `tools.timeout` is passed to constructors that
take a `timeout` argument and were not given one.

Mistakes in the config itself (a class that cannot be imported, a parameter the class does
not take) always raise `AppoError`. A tool whose construction fails at run time (a sandbox
that cannot start, a missing API key) raises when `tools.fail_on_error` is true and is
otherwise left out with a warning, as in the original.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from appo.errors import AppoError, ToolFatalError
from appo.tools.base import Tool
from appo.tools.executor import ToolExecutor

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """OmegaConf nodes -> plain containers (tool constructors get ordinary dicts/lists)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def import_class(class_path: str, where: str = "class_path") -> type:
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        raise AppoError(f"{where} {class_path!r} must be a dotted path such as "
                        "'appo.tools.python_tool.PythonTool'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AppoError(f"cannot import module {module_name!r} for {where} {class_path!r}: {e}"
                        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise AppoError(f"module {module_name!r} has no class {attr!r} ({where}){hint}"
                        ) from None


def _check_params(cls: type, kwargs: dict, where: str) -> None:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        valid = [n for n, p in params.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, valid, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise AppoError(f"{where}: unknown parameter(s) {', '.join(hints)}; "
                        f"{cls.__name__} takes {', '.join(valid)}")


def _accepts(cls: type, name: str) -> bool:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                 for p in params.values())


def build_tool(class_path: str, params: Mapping | None = None, *, name: str | None = None,
               defaults: Mapping | None = None, where: str | None = None) -> Tool:
    """Import `class_path` and construct it with `params` (plus any `defaults` the class
    accepts and `params` lacks). Raises AppoError for config mistakes; construction errors
    propagate as they are (AppoError or otherwise)."""
    where = where or (f"tools.tool_instances.{name}" if name else "tool")
    cls = import_class(class_path, f"{where}.class_path")
    kwargs = dict(_plain(params) or {})
    if not isinstance(kwargs, dict):
        raise AppoError(f"{where}.params must be a mapping, got {type(params).__name__}")
    _check_params(cls, kwargs, f"{where}.params")
    for key, value in dict(defaults or {}).items():
        if key not in kwargs and _accepts(cls, key):
            kwargs[key] = value
    if name is not None and "name" not in kwargs and _accepts(cls, "name"):
        kwargs["name"] = name
    tool = cls(**kwargs)
    # Protocol completion for minimal user tools: name and tag default to the instance name.
    if not hasattr(tool, "execute"):
        raise AppoError(f"{where}.class_path {class_path!r} has no execute(content) method")
    for attr in ("name", "tag"):
        if getattr(tool, attr, None) in (None, ""):
            try:
                setattr(tool, attr, name or getattr(tool, "name", None) or cls.__name__.lower())
            except AttributeError:
                raise AppoError(f"{where}: {cls.__name__} needs a {attr!r} attribute") from None
    if name is not None and tool.name != name:
        try:
            tool.name = name  # the instance name is what stats and calls refer to
        except AttributeError:
            pass
    return tool


def tool_schemas(tools_cfg: Any) -> list[dict]:
    """The function schemas of the enabled tools, from their classes (nothing is started):
    what the chat template gets as `tools=` with `tools.format=hermes`."""
    from appo.tools.formats import function_schema

    instances = _plain(_get(tools_cfg, "tool_instances", {})) or {}
    enabled = _plain(_get(tools_cfg, "enabled", None))
    schemas = []
    for name, inst in instances.items():
        if enabled is not None and name not in set(enabled):
            continue
        where = f"tools.tool_instances.{name}.class_path"
        schemas.append(function_schema(name, import_class(_get(inst, "class_path"), where)))
    return schemas


def build_tools(tools_cfg: Any) -> ToolExecutor:
    """`cfg.tools` (or anything with the same attributes/keys) -> a ready ToolExecutor."""
    instances = _plain(_get(tools_cfg, "tool_instances", {})) or {}
    enabled = _plain(_get(tools_cfg, "enabled", None))
    if enabled is not None:  # tools.enabled picks a subset of the defined instances
        instances = {k: v for k, v in instances.items() if k in set(enabled)}
    timeout = float(_get(tools_cfg, "timeout", 30.0))
    fail_on_error = bool(_get(tools_cfg, "fail_on_error", False))
    tools: dict[str, Tool] = {}
    for name, inst in instances.items():
        where = f"tools.tool_instances.{name}"
        class_path = _get(inst, "class_path")
        if not class_path:
            raise AppoError(f"config key '{where}.class_path' is not set")
        cls = import_class(class_path, f"{where}.class_path")
        _check_params(cls, dict(_get(inst, "params") or {}), f"{where}.params")
        try:
            tool = build_tool(class_path, _get(inst, "params") or {}, name=name,
                              defaults={"timeout": timeout})
        except Exception as e:
            if isinstance(e, ToolFatalError):
                raise  # broken local state (a damaged cache file), not a service that is down
            if fail_on_error:
                if isinstance(e, AppoError):
                    raise
                raise AppoError(f"cannot start tool {name!r} ({class_path}): "
                                f"{type(e).__name__}: {e}") from e
            log.warning("tool %r (%s) could not be started and is left out "
                        "(set tools.fail_on_error=true to stop instead): %s: %s",
                        name, class_path, type(e).__name__, e)
            continue
        tools[name] = tool
    tags = [t.tag for t in tools.values()]
    duplicated = {t for t in tags if tags.count(t) > 1}
    if duplicated:
        for tool in tools.values():
            close = getattr(tool, "close", None)
            if callable(close):
                close()
        raise AppoError(f"several tools share the trigger tag(s) {sorted(duplicated)}; "
                        "give each a distinct params.tag")
    return ToolExecutor(
        tools,
        max_workers=int(_get(tools_cfg, "max_workers", 8)),
        timeout=timeout,
        retry_count=int(_get(tools_cfg, "retry_count", 1)),
        infra_failure_limit=_get(tools_cfg, "infra_failure_limit", 16),
        verbose=bool(_get(tools_cfg, "verbose_logging", False)),
    )
