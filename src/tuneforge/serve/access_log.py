"""The server's log of its traffic: one line per request (method, path, status, latency, the tokens of a
generation, a refusal's message), as text for people or as one JSON object a line (`--log-format json`) for
machines, and the lines of a drain. Written to stderr, where the server's start-up line goes."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class Access:
    """One answered request."""

    method: str
    path: str
    status: int
    ms: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    request_id: str | None = None  # its x-request-id (the JSON format's lines carry it)


class AccessLog:
    def __init__(self, log_format: str = "text") -> None:
        self.log_format = log_format

    def request(self, access: Access) -> None:
        if self.log_format == "json":
            fields = {k: v for k, v in asdict(access).items() if v is not None}
            self._write(json.dumps({"time": round(time.time(), 3), **fields}, ensure_ascii=True))
            return
        line = f"{access.method} {ascii(access.path)[1:-1]} {access.status} {access.ms:.0f} ms"
        if access.prompt_tokens is not None:
            line += f" prompt_tokens={access.prompt_tokens} completion_tokens={access.completion_tokens}"
        if access.error:
            line += f": {ascii(access.error)[1:-1]}"
        self._write(line)

    def event(self, message: str) -> None:
        """A line of the server's own (a drain), in the log's format."""
        self._write(
            json.dumps({"time": round(time.time(), 3), "event": message}) if self.log_format == "json" else message
        )

    @staticmethod
    def _write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
