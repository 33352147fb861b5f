"""`tuneforge serve MODEL_DIR`: an HTTP server for any model folder tuneforge exports.

The task that exported the folder says what runs (`predict.load_servable`): a model that generates text
(causal LM, chat SFT, seq2seq, their adapter folders) gets the OpenAI-compatible routes with continuous
batching (serve/engine.py); a classifier, tagger, qa or multiple-choice model gets `POST /predict` with
dynamic batching (serve/batching.py); a sentence encoder gets OpenAI's `POST /v1/embeddings`, batched the same
way. All get the page at `/`, `/health`, `/metrics` and the gate of serve/app.py (API key, body size limit,
draining on SIGTERM).

This module owns the command: its arguments (ServeOptions' fields, serve/options.py, checked in one step: one line
each, exit 2), binding the port before anything heavy, and the uvicorn server (SIGTERM: stop taking requests,
finish those in flight). If the generation engine dies (the model fails even a one-token forward pass), /health
answers {"status": "error"} and the process exits 1 with one `error:` line, so that a supervisor restarts it.
The package, in layers as vLLM's entrypoints: options.py (ServeOptions: the arguments, their defaults and bounds),
app.py (the app factory, the server's state and own routes, the errors), gate.py (API key, body size, draining,
metrics of every request), routes_openai.py, routes_predict.py and routes_embeddings.py (one module per API),
generation.py (the generation service: prompt encoding, context limit, sampling parameters, answers and streams),
engine.py (continuous batching; the running batch of each model family is tuneforge/running_batch.py),
detokenize.py (incremental text), batching.py (classifiers, sentence encoders), openai_api.py (request and response
shapes), metrics.py (Prometheus text), static/index.html.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys

from tuneforge.errors import ConfigError
from tuneforge.flags import add_model_flags, parse_options
from tuneforge.serve.options import API_KEY_VARIABLE, ServeOptions


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


def cmd_serve(ns: argparse.Namespace) -> int:
    from tuneforge.artifacts import check_model_path
    from tuneforge.launch import env_flag

    if ns.api_key is None:  # no --api-key: the environment's
        ns = argparse.Namespace(**{**vars(ns), "api_key": env_flag(API_KEY_VARIABLE)})
    options = parse_options(ServeOptions, ns)  # every flag checked before any work: one line naming it
    check_model_path(options.model_dir)
    try:
        import fastapi  # noqa: F401  (the app's)
        import uvicorn  # noqa: F401  (the server's)
    except ImportError as err:
        raise ConfigError(
            f"`tuneforge serve` needs fastapi and uvicorn ({err.name or err} is missing): pip install fastapi uvicorn"
        ) from None
    from tuneforge.predict import load_servable
    from tuneforge.serve.app import create_app

    sock = bind_socket(options.host, options.port)
    failed: list[BaseException] = []

    def on_fatal(err: BaseException) -> None:  # the model failed to load, or the engine died (its thread)
        failed.append(err)
        server.should_exit = True

    load = lambda: load_servable(options.model_dir, max_length=options.max_length)  # noqa: E731
    app = create_app(load, options, on_fatal, owns_process=True)
    server = draining_server(app, options.request_timeout_s)
    host, port = sock.getsockname()[:2]
    print(
        f"serving {options.model_dir} on http://{host}:{port} (the page at /, GET /health, GET /metrics; POST "
        f"/predict for classifiers, /v1/embeddings for sentence encoders, /v1/completions and /v1/chat/completions "
        f"for text generation); batches of up "
        f"to {options.max_batch_size}, at most {options.max_queue} waiting"
        f"{'; API key required' if options.api_key else ''}",
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
    """`tuneforge serve`'s arguments: ServeOptions' fields (serve/options.py)."""
    add_model_flags(p, ServeOptions)
    p.set_defaults(func=cmd_serve)
