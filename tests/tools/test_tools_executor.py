"""ToolExecutor (concurrency, order, retries, timeouts, stats) and the config registry."""

from __future__ import annotations

import threading
import time

import pytest

from appo.config import load_config
from appo.errors import AppoError
from appo.tools import Tool, ToolResult
from appo.tools.executor import ToolCall, ToolExecutor, _percentile
from appo.tools.registry import build_tool, build_tools


class EchoTool:
    """Returns its input; sleeps `delay` seconds; counts calls."""

    enforces_timeout = True

    def __init__(self, name: str = "echo", tag: str | None = None, delay: float = 0.0):
        self.name, self.tag, self.delay = name, tag or name, delay
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def execute(self, content: str) -> ToolResult:
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.delay)
        with self._lock:
            self.active -= 1
        return ToolResult(content.upper(), latency_s=self.delay)


class FlakyTool:
    """Fails with an infra error `failures` times, then succeeds."""

    enforces_timeout = True

    def __init__(self, name: str = "flaky", failures: int = 1, kind: str = "infra"):
        self.name = self.tag = name
        self.failures, self.kind, self.calls = failures, kind, 0

    def execute(self, content: str) -> ToolResult:
        self.calls += 1
        if self.calls <= self.failures:
            return ToolResult("boom", ok=False, error_kind=self.kind)
        return ToolResult("fine")


class RaisingTool:
    name = tag = "raiser"
    enforces_timeout = True

    def __init__(self):
        self.calls = 0

    def execute(self, content: str) -> ToolResult:
        self.calls += 1
        raise RuntimeError("bug in tool")


class HangingTool:
    """Does not bound its own run time (no enforces_timeout): the executor's watchdog must."""

    name = tag = "hang"

    def execute(self, content: str) -> ToolResult:
        time.sleep(60)
        return ToolResult("late")


class MinimalTool:
    """A user tool with neither name nor tag, returning plain text."""

    def __init__(self, prefix: str = ">"):
        self.prefix = prefix

    def execute(self, content: str) -> str:
        return f"{self.prefix}{content}"


def test_results_in_call_order_and_concurrent():
    echo = EchoTool(delay=0.2)
    ex = ToolExecutor({"echo": echo}, max_workers=4)
    start = time.monotonic()
    results = ex.execute_many([ToolCall("echo", f"q{i}") for i in range(8)])
    elapsed = time.monotonic() - start
    assert [r.text for r in results] == [f"Q{i}" for i in range(8)]
    assert echo.max_active == 4
    # 8 calls of 0.2 s on 4 workers: two waves, ~0.4 s; below the serial 1.6 s however
    # busy the machine (the calls sleep; they need no CPU).
    assert elapsed < 8 * 0.2
    ex.close()


def test_unknown_tool_and_empty_content_are_error_results():
    ex = ToolExecutor({"echo": EchoTool()})
    unknown, empty, good = ex.execute_many(
        [ToolCall("nope", "x"), ToolCall("echo", "  "), ToolCall("echo", "x")])
    assert not unknown.ok and "unknown tool 'nope'" in unknown.text and "echo" in unknown.text
    assert not empty.ok and empty.error_kind == "error"
    assert good.ok and good.text == "X"
    ex.close()


def test_consecutive_infra_failures_stop_at_the_limit_and_a_success_resets_them():
    from appo.errors import ToolFatalError

    tool = FlakyTool(name="web", failures=2)  # fails twice, then works
    ex = ToolExecutor({"web": tool}, retry_count=0, infra_failure_limit=3)
    assert [ex.execute(ToolCall("web", "x")).error_kind for _ in range(3)] == [
        "infra", "infra", None]
    tool.calls, tool.failures = 0, 10  # down for good
    assert [ex.execute(ToolCall("web", "x")).error_kind for _ in range(2)] == ["infra"] * 2
    with pytest.raises(ToolFatalError, match=r"^tool web: 3 calls in a row failed .*last: boom"):
        ex.execute(ToolCall("web", "x"))
    # Off (null): the model gets every failure, as the original did.
    ex2 = ToolExecutor({"web": FlakyTool(name="web", failures=50)}, retry_count=0)
    assert all(ex2.execute(ToolCall("web", "x")).error_kind == "infra" for _ in range(20))
    for e in (ex, ex2):
        e.close()


def test_call_by_tag():
    ex = ToolExecutor({"web": EchoTool(name="web", tag="search")})
    assert ex.tags == ["search"]
    assert ex.execute(ToolCall("search", "hi")).text == "HI"
    ex.close()


def test_retry_only_on_infra_failure():
    flaky = FlakyTool(failures=1)
    ex = ToolExecutor({"flaky": flaky}, retry_count=1)
    result = ex.execute(ToolCall("flaky", "x"))
    assert result.ok and result.text == "fine" and flaky.calls == 2
    assert ex.stats()["flaky"].retries == 1

    # A model error (e.g. code that printed nothing or raised) is never retried.
    model_error = FlakyTool(name="py", failures=5, kind="error")
    ex2 = ToolExecutor({"py": model_error}, retry_count=3)
    assert not ex2.execute(ToolCall("py", "x")).ok
    assert model_error.calls == 1

    # Retries are bounded: retry_count=2 -> at most 3 attempts.
    stubborn = FlakyTool(name="s", failures=10)
    ex3 = ToolExecutor({"s": stubborn}, retry_count=2)
    result = ex3.execute(ToolCall("s", "x"))
    assert result.error_kind == "infra" and stubborn.calls == 3
    assert ex3.stats()["s"].infra_errors == 1
    for e in (ex, ex2, ex3):
        e.close()


def test_timeouts_are_retried_only_for_tools_that_ask_for_it():
    # A program that ran out of time (python) would do so again: run once.
    slow_code = FlakyTool(name="py", failures=1, kind="timeout")
    ex = ToolExecutor({"py": slow_code}, retry_count=2)
    result = ex.execute(ToolCall("py", "x"))
    assert result.error_kind == "timeout" and slow_code.calls == 1
    # A search server that did not answer may answer the next time (SearchTool sets it).
    server = FlakyTool(name="web", failures=1, kind="timeout")
    server.retry_timeouts = True
    ex2 = ToolExecutor({"web": server}, retry_count=2)
    result = ex2.execute(ToolCall("web", "q"))
    assert result.ok and server.calls == 2 and ex2.stats()["web"].retries == 1
    for e in (ex, ex2):
        e.close()


def test_search_tool_asks_for_timeout_retries():
    from appo.tools.python_tool import PythonTool
    from appo.tools.search_tool import SearchTool

    assert SearchTool.retry_timeouts and not getattr(PythonTool, "retry_timeouts", False)


def test_tool_exception_becomes_infra_result_and_is_retried():
    raiser = RaisingTool()
    ex = ToolExecutor({"raiser": raiser}, retry_count=1)
    result = ex.execute(ToolCall("raiser", "x"))
    assert not result.ok and result.error_kind == "infra"
    assert "RuntimeError: bug in tool" in result.text
    assert raiser.calls == 2
    ex.close()


def test_watchdog_times_out_tools_that_do_not_bound_themselves():
    ex = ToolExecutor({"hang": HangingTool()}, timeout=0.3)
    start = time.monotonic()
    result = ex.execute(ToolCall("hang", "x"))
    assert result.error_kind == "timeout" and not result.ok
    assert time.monotonic() - start < 30  # the watchdog's 0.3 s, not the tool's 60 s
    assert ex.stats()["hang"].timeouts == 1
    ex.close()


def test_percentile_nearest_rank_hand_computed():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert _percentile(values, 50) == 50.0  # rank ceil(0.5 * 100) = 50
    assert _percentile(values, 90) == 90.0
    assert _percentile(values, 99) == 99.0
    assert _percentile([3.0], 99) == 3.0
    assert _percentile([], 50) == 0.0
    # n = 10: p99 -> rank ceil(9.9) = 10 -> the maximum.
    assert _percentile([float(v) for v in range(10)], 99) == 9.0


def test_stats_counts_and_reset():
    echo = EchoTool()

    class CachedTool(EchoTool):
        def execute(self, content):
            return ToolResult("hit", cached=True)

    ex = ToolExecutor({"echo": echo, "cached": CachedTool(name="cached")})
    ex.execute_many([ToolCall("echo", "a"), ToolCall("echo", ""), ToolCall("cached", "q"),
                     ToolCall("cached", "q")])
    stats = ex.stats()
    assert stats["echo"].calls == 2 and stats["echo"].failures == 1
    assert stats["cached"].calls == 2 and stats["cached"].cache_hits == 2
    assert stats["echo"].latency_p99 >= stats["echo"].latency_p50 >= 0.0
    metrics = ex.metrics(reset=True)
    assert metrics["tools/cached/cache_hits"] == 2.0
    assert ex.stats()["echo"].calls == 0
    ex.close()


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_build_tools_from_default_config_gives_python():
    cfg = load_config(overrides=["tools.timeout=5", "tools.max_workers=2"])
    ex = build_tools(cfg.tools)
    try:
        assert ex.tags == ["python"]
        tool = ex.tools["python"]
        assert tool.limits.timeout == 5.0  # tools.timeout reached the sandbox
        results = ex.execute_many([ToolCall("python", "1 + 1"), ToolCall("python", "2 * 3")])
        assert [r.text for r in results] == ["2", "6"]
    finally:
        ex.close()


def test_user_class_path_with_params_and_protocol_completion():
    path = f"{__name__}.MinimalTool"
    cfg = {"tool_instances": {"calc": {"class_path": path, "params": {"prefix": "=>"}}},
           "timeout": 2.0}
    ex = build_tools(cfg)
    tool = ex.tools["calc"]
    assert tool.name == "calc" and tool.tag == "calc"  # filled in from the instance name
    assert isinstance(tool, Tool)
    result = ex.execute(ToolCall("calc", "x"))
    assert result.ok and result.text == "=>x"
    ex.close()


def test_build_tool_errors_name_the_problem():
    with pytest.raises(AppoError, match="cannot import module"):
        build_tool("no_such_module.Tool", {}, name="t")
    with pytest.raises(AppoError, match="has no class 'EchoTol'.*did you mean EchoTool"):
        build_tool(f"{__name__}.EchoTol", {}, name="t")
    with pytest.raises(AppoError, match="unknown parameter.*'dealy' \\(did you mean 'delay'"):
        build_tool(f"{__name__}.EchoTool", {"dealy": 1}, name="t")
    with pytest.raises(AppoError, match="dotted path"):
        build_tool("EchoTool", {}, name="t")


class BrokenTool:
    def __init__(self, name: str = "broken"):
        raise RuntimeError("cannot start")


def test_fail_on_error_controls_tools_that_cannot_start(caplog):
    instances = {
        "echo": {"class_path": f"{__name__}.EchoTool"},
        "broken": {"class_path": f"{__name__}.BrokenTool"},
    }
    ex = build_tools({"tool_instances": instances, "fail_on_error": False})
    assert ex.tags == ["echo"]
    assert "could not be started" in caplog.text
    ex.close()
    with pytest.raises(AppoError, match="cannot start tool 'broken'.*cannot start"):
        build_tools({"tool_instances": instances, "fail_on_error": True})
    # A config mistake raises whatever fail_on_error says.
    bad = {"x": {"class_path": f"{__name__}.EchoTool", "params": {"nope": 1}}}
    with pytest.raises(AppoError, match="unknown parameter"):
        build_tools({"tool_instances": bad, "fail_on_error": False})


def test_duplicate_tags_rejected():
    instances = {
        "a": {"class_path": f"{__name__}.EchoTool", "params": {"tag": "same"}},
        "b": {"class_path": f"{__name__}.EchoTool", "params": {"tag": "same"}},
    }
    with pytest.raises(AppoError, match="share the trigger tag"):
        build_tools({"tool_instances": instances})


def test_tools_package_and_cli_module_import_light():
    import subprocess
    import sys

    code = ("import sys, appo.tools, appo.tools.commands\n"
            "heavy = [m for m in ('torch', 'numpy', 'bm25s', 'sympy') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_build_tools_respects_enabled(tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path))
    cfg = load_config(overrides=[
        "tools.tool_instances.search.class_path=appo.tools.search_tool.SearchTool",
        "tools.tool_instances.search.params.miss_policy=fail",  # backend never started
        "tools.enabled=[search]",
        "tools.fail_on_error=true",
    ])
    executor = build_tools(cfg.tools)
    try:
        assert executor.tags == ["search"]
    finally:
        executor.close()
