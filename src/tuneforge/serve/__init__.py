"""`tuneforge serve MODEL_DIR`: an HTTP server for any model folder tuneforge exports.

The task that exported the folder says what runs (`predict.load_servable`): a model that generates text
(causal LM, chat SFT, seq2seq, their adapter folders) gets the OpenAI-compatible routes with continuous
batching (serve/engine.py); a classifier, tagger, qa or multiple-choice model gets `POST /predict` with
dynamic batching (serve/batching.py). Both get the page at `/`, `/health`, `/metrics` and the gate of
serve/app.py (API key, body size limit, draining on SIGTERM).

This module owns the command line: its arguments, their checks (finite bounds; one line each, exit 2), binding
the port before anything heavy, and the uvicorn server (SIGTERM: stop taking requests, finish those in flight).
If the generation engine dies (the model fails even a one-token forward pass), /health answers
{"status": "error"} and the process exits 1 with one `error:` line, so that a supervisor restarts it.
The package, in layers as vLLM's entrypoints: options.py (ServeOptions and their flags), app.py (the app factory,
the server's state and own routes, the errors), gate.py (API key, body size, draining, metrics of every request),
routes_openai.py and routes_predict.py (one module per API), generation.py (the generation service: prompt
encoding, context limit, sampling parameters, answers and streams), engine.py (continuous batching; the running
batch of each model family is tuneforge/running_batch.py), detokenize.py (incremental text), batching.py
(classifiers), openai_api.py (request and response shapes), metrics.py (Prometheus text), static/index.html.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys

from tuneforge.errors import ConfigError
from tuneforge.serve.options import add_flags, from_namespace

API_KEY_VARIABLE = "TUNEFORGE_API_KEY"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything heavy, so a busy port is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}); pass another --port or --host") from None
    return sock


# each flag's finite bounds: a value outside them (inf, nan, or one that overflows what it feeds) is one line
INT_BOUNDS = {
    "--max-batch-size": ("max_batch_size", 1, 65536),
    "--max-queue": ("max_queue", 1, 1_000_000),
    "--max-body-bytes": ("max_body_bytes", 1, 1 << 31),
    "--default-max-tokens": ("default_max_tokens", 1, 1 << 20),
}
MAX_WAIT_MS = 60_000.0  # a classifier request waits at most a minute for others
MAX_REQUEST_TIMEOUT_S = 86_400.0  # a day


def check_arguments(ns: argparse.Namespace) -> None:
    """Every serve flag checked before any work: one line naming the flag."""
    for flag, (name, low, high) in INT_BOUNDS.items():
        value = getattr(ns, name)
        if value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
        if not low <= value <= high:
            raise ConfigError(f"{flag} must be between {low} and {high}, got {value}")
    if not 0 <= ns.max_wait_ms <= MAX_WAIT_MS:  # false for nan too
        raise ConfigError(f"--max-wait-ms must be between 0 and {MAX_WAIT_MS:g}, got {ns.max_wait_ms:g}")
    if not ns.request_timeout > 0:
        raise ConfigError(f"--request-timeout must be above 0 seconds, got {ns.request_timeout:g}")
    if not ns.request_timeout <= MAX_REQUEST_TIMEOUT_S:
        raise ConfigError(
            f"--request-timeout must be at most {MAX_REQUEST_TIMEOUT_S:g} seconds (a day), got {ns.request_timeout:g}"
        )
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port must be between 0 and 65535, got {ns.port}")
    if ns.max_length is not None and not 1 <= ns.max_length <= 1 << 20:
        raise ConfigError(f"--max-length must be between 1 and {1 << 20}, got {ns.max_length}")
    if ns.api_key is not None and not ns.api_key.strip():
        raise ConfigError(f"--api-key (or {API_KEY_VARIABLE}) is empty; give a key or leave it unset")
    if ns.served_model_name is not None and not ns.served_model_name.strip():
        raise ConfigError("--served-model-name is empty; give a name or leave it out")


def cmd_serve(ns: argparse.Namespace) -> int:
    from tuneforge.artifacts import check_model_path
    from tuneforge.launch import env_flag

    if ns.api_key is None:
        ns.api_key = env_flag(API_KEY_VARIABLE)
    check_arguments(ns)
    check_model_path(ns.model_dir)
    try:
        import fastapi  # noqa: F401  (the app's)
        import uvicorn  # noqa: F401  (the server's)
    except ImportError as err:
        raise ConfigError(
            f"`tuneforge serve` needs fastapi and uvicorn ({err.name or err} is missing): pip install fastapi uvicorn"
        ) from None
    from tuneforge.predict import load_servable
    from tuneforge.serve.app import create_app

    sock = bind_socket(ns.host, ns.port)
    failed: list[BaseException] = []

    def on_fatal(err: BaseException) -> None:  # the model failed to load, or the engine died (its thread)
        failed.append(err)
        server.should_exit = True

    app = create_app(lambda: load_servable(ns.model_dir, max_length=ns.max_length), from_namespace(ns), on_fatal)
    server = draining_server(app, ns.request_timeout)
    host, port = sock.getsockname()[:2]
    print(
        f"serving {ns.model_dir} on http://{host}:{port} (the page at /, GET /health, GET /metrics; POST /predict "
        f"for classifiers, /v1/completions and /v1/chat/completions for text generation); batches of up to "
        f"{ns.max_batch_size}, at most {ns.max_queue} waiting{'; API key required' if ns.api_key else ''}",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    return exit_status(failed[0] if failed else None, app.state.server.served is not None)


def draining_server(app, request_timeout: float):
    """A uvicorn server whose SIGTERM / Ctrl-C stops taking requests and finishes those in flight."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.server.begin_draining()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, except that the signal is not raised again after the shutdown: a server that drained
            on SIGTERM exits 0."""
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=int(request_timeout) + 5
    )
    return Server(config)


def exit_status(failed: BaseException | None, served: bool) -> int:
    """0 after a clean stop; a model that failed to load raises (the CLI's one line); an engine that died after
    serving: one `error:` line and 1, so that a supervisor restarts the server."""
    if failed is None:
        return 0
    if not served:
        raise failed
    first = (str(failed).strip().splitlines() or [""])[0][:300]
    print(
        f"error: the generation engine stopped ({type(failed).__name__}: {first}); the server exits so that a "
        "supervisor can restart it",
        file=sys.stderr,
        flush=True,
    )
    return 1


def add_arguments(p) -> None:
    """`tuneforge serve`'s arguments (the CLI lists the command and its help)."""
    p.add_argument("model_dir", help="a model folder tuneforge exported (OUTPUT_DIR/model, an adapter folder too)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-length", type=int, default=None, help="truncate inputs (default: the training max_length)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"required on every route but /health (Authorization: Bearer KEY); default: ${API_KEY_VARIABLE}",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name of the OpenAI routes (default: MODEL_DIR as given)"
    )
    add_flags(p)  # the server's settings: flags and defaults from ServeOptions (serve/options.py)
    p.set_defaults(func=cmd_serve)
