"""A scripted OpenAI-compatible server on 127.0.0.1 for the eval tests.

It speaks `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` and any
POST path given in `routes` (e.g. vLLM's dev routes), records every request (path, headers,
JSON body) and answers from a script: a function of the request body returning a reply dict
(sent as 200 JSON) or a `Reply` (any status, raw body, or a delay before answering, for
timeouts).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # dict -> JSON; str/bytes -> sent as is
    delay: float = 0.0


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any


Script = Callable[[dict], "dict | Reply"]


def completion(text: str, finish: str = "stop", **extra) -> dict:
    """A completions reply with one choice (extra keys go into the choice, e.g. stop_reason)."""
    return {"id": "cmpl-test", "object": "text_completion", "model": "scripted-model",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}}


def chat(content: str) -> dict:
    return {"id": "chat-test", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}]}


@dataclass
class ScriptedServer:
    completions: Script | None = None
    chat: Script | None = None
    models: tuple[str, ...] = ("scripted-model",)
    routes: dict[str, Script] = field(default_factory=dict)  # further POST paths
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, reply: Reply) -> None:
                if reply.delay:
                    time.sleep(reply.delay)
                body = reply.body
                if isinstance(body, dict | list):
                    body = json.dumps(body)
                data = body.encode() if isinstance(body, str) else (body or b"")
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def do_GET(self) -> None:
                server._record(self.path, dict(self.headers), None)
                if self.path.rstrip("/") == "/v1/models":
                    self._send(Reply(body={"object": "list", "data": [
                        {"id": m, "object": "model"} for m in server.models]}))
                else:
                    self._send(Reply(404, {"error": "not found"}))

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"null")
                server._record(self.path, dict(self.headers), body)
                script = {"/v1/completions": server.completions,
                          "/v1/chat/completions": server.chat,
                          **server.routes}.get(self.path.split("?")[0])
                if script is None:
                    self._send(Reply(404, {"error": f"no route {self.path}"}))
                    return
                try:
                    reply = script(body)
                except AssertionError as e:  # the script checks requests: report as 422
                    reply = Reply(422, {"error": f"script assertion: {e}"})
                self._send(reply if isinstance(reply, Reply) else Reply(body=reply))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _record(self, path: str, headers: dict, body: Any) -> None:
        with self._lock:
            self.requests.append(Request(path, headers, body))

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def posts(self, path: str = "/v1/completions") -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class EchoTool:
    """A second tool for per-tool limit tests (`tools.tool_instances.echo.class_path`)."""

    name = tag = "echo"

    def execute(self, content: str):
        from appo.tools.base import ToolResult

        return ToolResult(content)
