"""Concurrent tool execution with per-call timeout, infra-only retries and per-tool statistics.

The original (ARPO) ran tool calls in a thread pool and ran a call again while its output was
empty or it raised, up to `retry_count` (3) runs in all: a program that printed nothing ran
three times, then the model got "Tool(python) returned empty output.". Here a call is retried
only when the tool reports an infrastructure failure (`error_kind="infra"`: a dead worker,
HTTP 5xx, a refused connection) or raises; whatever the model wrote is run once. A timeout is
retried only for tools that declare `retry_timeouts = True` (search: a server that did not
answer may answer the next time); a program that ran out of time would do so again.

A tool's exception becomes an error result the model sees, except `ToolFatalError` (a tool
that cannot work at all, such as a damaged search cache), which is raised to the caller. So
is a tool whose last `infra_failure_limit` calls all ended in an infrastructure failure
(`tools.infra_failure_limit`): a server that is down would otherwise hand the model an error
text for every call, with log warnings only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from appo.errors import ToolFatalError
from appo.tools.base import Tool, ToolResult

log = logging.getLogger(__name__)

# Latencies kept per tool for the percentiles (a window, so long runs stay bounded).
_LATENCY_WINDOW = 10_000


@dataclass
class ToolCall:
    tool: str  # tool name (or its trigger tag)
    content: str
    # The rollout's steps so far (model segments and results), for tools that set
    # `takes_context` (the search tool's page step); others never see it.
    context: tuple[str, ...] = ()


@dataclass
class ToolStats:
    calls: int = 0
    failures: int = 0  # results with ok=False (timeouts included)
    timeouts: int = 0
    infra_errors: int = 0  # failures left after retries
    retries: int = 0
    cache_hits: int = 0
    latency_mean: float = 0.0
    latency_p50: float = 0.0
    latency_p90: float = 0.0
    latency_p99: float = 0.0

    def to_metrics(self, prefix: str) -> dict[str, float]:
        """Flat `{prefix}/{field}` floats for a metrics logger."""
        return {f"{prefix}/{k}": float(v) for k, v in self.__dict__.items()}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not sorted_values:
        return 0.0
    rank = max(1, int(-(-q * len(sorted_values) // 100)))  # ceil(q/100 * n)
    return sorted_values[min(rank, len(sorted_values)) - 1]


class _StatsAccumulator:
    def __init__(self) -> None:
        self.stats = ToolStats()
        self.latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self.total_latency = 0.0

    def record(self, result: ToolResult, retries: int) -> None:
        s = self.stats
        s.calls += 1
        s.retries += retries
        s.failures += not result.ok
        s.timeouts += result.error_kind == "timeout"
        s.infra_errors += result.error_kind == "infra"
        s.cache_hits += bool(result.cached)
        self.latencies.append(result.latency_s)
        self.total_latency += result.latency_s

    def snapshot(self) -> ToolStats:
        ordered = sorted(self.latencies)
        s = ToolStats(**self.stats.__dict__)
        s.latency_mean = self.total_latency / s.calls if s.calls else 0.0
        s.latency_p50 = _percentile(ordered, 50)
        s.latency_p90 = _percentile(ordered, 90)
        s.latency_p99 = _percentile(ordered, 99)
        return s


class ToolExecutor:
    """Runs tool calls concurrently; `execute_many` keeps the call order and raises only
    `ToolFatalError` (a tool that cannot work at all)."""

    def __init__(
        self,
        tools: dict[str, Tool],
        max_workers: int = 8,
        timeout: float = 30.0,
        retry_count: int = 1,
        verbose: bool = False,
        infra_failure_limit: int | None = None,
    ):
        self.tools = dict(tools)
        self._by_tag = {tool.tag: tool for tool in self.tools.values()}
        self.timeout = float(timeout)
        self.retry_count = max(0, int(retry_count))
        self.verbose = verbose
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(max_workers)),
                                        thread_name_prefix="appo-tool")
        self._stats = {name: _StatsAccumulator() for name in self.tools}
        self._stats_lock = threading.Lock()
        self.infra_failure_limit = infra_failure_limit
        self._infra_streak = dict.fromkeys(self.tools, 0)  # consecutive infra failures

    @property
    def tags(self) -> list[str]:
        return [tool.tag for tool in self.tools.values()]

    @property
    def schemas(self) -> list[dict]:
        """Each tool's function schema (native call formats, `tools.format=hermes`)."""
        from appo.tools.formats import function_schema

        return [function_schema(name, tool) for name, tool in self.tools.items()]

    def resolve(self, name_or_tag: str) -> Tool | None:
        return self.tools.get(name_or_tag) or self._by_tag.get(name_or_tag)

    def execute(self, call: ToolCall) -> ToolResult:
        return self.execute_many([call])[0]

    def execute_many(self, calls: list[ToolCall]) -> list[ToolResult]:
        if not calls:
            return []
        if len(calls) == 1:  # no thread hop for a single call
            return [self._run(calls[0])]
        return list(self._pool.map(self._run, calls))

    # -- one call -----------------------------------------------------------------------------

    def _run(self, call: ToolCall) -> ToolResult:
        start = time.monotonic()
        tool = self.resolve(call.tool)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"Error: unknown tool {call.tool!r} (available: {known}).",
                              ok=False, error_kind="error")
        if not call.content.strip():
            result = ToolResult(f"Error: empty <{tool.tag}> call: nothing to run.", ok=False,
                                error_kind="error")
            retries = 0
        else:
            result, retries = self._attempts(tool, call)
        result.latency_s = time.monotonic() - start
        with self._stats_lock:
            self._stats[tool.name].record(result, retries)
            streak = self._infra_streak[tool.name] + 1 if result.error_kind == "infra" else 0
            self._infra_streak[tool.name] = streak
        limit = self.infra_failure_limit
        if limit is not None and streak >= limit:
            last = " ".join(result.text.split())[:200]
            raise ToolFatalError(f"tool {tool.name}: {streak} calls in a row failed outside the "
                                 f"model's control (last: {last}); is its server or backend "
                                 "up? (tools.infra_failure_limit; null: never stop)")
        if self.verbose:
            log.info("tool %s ok=%s kind=%s %.3fs cached=%s retries=%d", tool.name, result.ok,
                     result.error_kind, result.latency_s, result.cached, retries)
        return result

    def _attempts(self, tool: Tool, call: ToolCall) -> tuple[ToolResult, int]:
        retried = {"infra", "timeout"} if getattr(tool, "retry_timeouts", False) else {"infra"}
        result = ToolResult("", ok=False, error_kind="infra")
        for attempt in range(self.retry_count + 1):
            if attempt:
                time.sleep(min(0.05 * 2**attempt, 2.0))
            result = self._attempt(tool, call)
            if result.error_kind not in retried:
                return result, attempt
            log.warning("tool %s %s (attempt %d/%d): %s", tool.name,
                        "timed out" if result.error_kind == "timeout" else
                        "infrastructure failure", attempt + 1, self.retry_count + 1,
                        result.text[:200])
        return result, self.retry_count

    def _attempt(self, tool: Tool, call: ToolCall) -> ToolResult:
        if getattr(tool, "enforces_timeout", False):
            return self._call(tool, call)
        # A tool that does not bound its own run time gets a watchdog thread; on timeout the
        # thread is abandoned (Python cannot kill it) and the call reports a timeout.
        box: list[ToolResult | ToolFatalError] = []

        def work() -> None:
            try:
                box.append(self._call(tool, call))
            except ToolFatalError as e:  # handed to the caller's thread
                box.append(e)

        worker = threading.Thread(target=work, daemon=True, name=f"appo-tool-{tool.name}")
        worker.start()
        worker.join(self.timeout)
        if box:
            if isinstance(box[0], ToolFatalError):
                raise box[0]
            return box[0]
        log.warning("tool %s did not return within %.1f s; abandoning the call", tool.name,
                    self.timeout)
        return ToolResult(f"Error: the {tool.name} tool timed out after {self.timeout:g} s.",
                          ok=False, error_kind="timeout")

    @staticmethod
    def _call(tool: Tool, call: ToolCall) -> ToolResult:
        try:
            if getattr(tool, "takes_context", False):
                result = tool.execute(call.content, context=call.context)  # type: ignore[call-arg]
            else:
                result = tool.execute(call.content)
        except ToolFatalError:
            raise  # the run must stop: every later call would fail the same way
        except Exception as e:  # noqa: BLE001 - a tool bug must not kill the rollout
            log.exception("tool %s raised", tool.name)
            return ToolResult(f"Error: the {tool.name} tool failed ({type(e).__name__}: {e}).",
                              ok=False, error_kind="infra")
        if not isinstance(result, ToolResult):  # user tools may return plain text
            result = ToolResult(str(result))
        return result

    # -- stats and lifecycle -------------------------------------------------------------

    def stats(self, reset: bool = False) -> dict[str, ToolStats]:
        with self._stats_lock:
            snapshot = {name: acc.snapshot() for name, acc in self._stats.items()}
            if reset:
                self._stats = {name: _StatsAccumulator() for name in self.tools}
        return snapshot

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """All tools' statistics as flat `tools/{name}/{field}` floats."""
        out: dict[str, float] = {}
        for name, s in self.stats(reset=reset).items():
            out.update(s.to_metrics(f"tools/{name}"))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tool in self.tools.values():
            close = getattr(tool, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - closing must not mask the real error
                    log.exception("closing tool %s failed", tool.name)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
