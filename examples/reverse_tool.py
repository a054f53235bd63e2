"""Tutorial tool (docs/tutorial.md): `<reverse>text</reverse>` answers with the text reversed.

A tool is any importable class with a `name`, a `tag` (the model triggers it with
`<tag>...</tag>`) and `execute(content) -> ToolResult`; the constructor gets
`tools.tool_instances.<name>.params` as keyword arguments. `execute` never raises for what the
model wrote: a bad input is an `ok=False` result whose text the model reads.
"""

from appo.tools.base import ToolResult


class ReverseTool:
    def __init__(self, name: str = "reverse", max_chars: int = 200):
        self.name = name
        self.tag = name
        self.max_chars = max_chars

    def execute(self, content: str) -> ToolResult:
        text = content.strip()
        if not text:
            return ToolResult("error: nothing to reverse", ok=False, error_kind="error")
        if len(text) > self.max_chars:
            return ToolResult(f"error: input longer than {self.max_chars} characters",
                              ok=False, error_kind="error")
        return ToolResult(text[::-1])

    def close(self) -> None:  # optional: called when the run ends
        pass
