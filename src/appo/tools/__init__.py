"""Tools the model calls during a rollout: python sandbox, search backends, registry.

Torch-free on purpose: the CLI and the rollout import it; the sandbox zygote runs
`sandbox/zygote_main.py` as a plain script. Importing this package loads no heavy module (the
sandbox, bm25s and numpy load when a tool is built).

    from appo.tools import ToolCall, build_tools
    executor = build_tools(cfg.tools)          # tools.tool_instances.<name>.{class_path, params}
    results = executor.execute_many([ToolCall("python", "1 + 1")])
"""

from appo.tools.base import Tool, ToolResult
from appo.tools.executor import ToolCall, ToolExecutor, ToolStats
from appo.tools.registry import build_tool, build_tools

__all__ = ["Tool", "ToolResult", "ToolCall", "ToolExecutor", "ToolStats", "build_tool",
           "build_tools"]
