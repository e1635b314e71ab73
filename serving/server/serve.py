"""`draftheads serve`: the engine behind an OpenAI-compatible HTTP API (serving.server.app) on uvicorn.

SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight finish for up to --shutdown-timeout
seconds, aborts the rest, stops the engine loop and exits 0.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
from dataclasses import dataclass, fields

import uvicorn

from serving.config import DTYPES, HELP as ENGINE_HELP, TYPES as ENGINE_TYPES, WEIGHTS, EngineConfig
from serving.config_file import CONFIG_HELP, add_options, merge_options

ENGINE_OPTIONS = ("target", "speculative_config", "dtype", "weights", "device", "block_size", "kv_cache_memory_gib", "max_num_seqs",
                  "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "num_threads")
HELP = {
    "config": CONFIG_HELP,
    **{name: ENGINE_HELP[name] for name in ENGINE_OPTIONS},
    "served_model_name": "the name clients give as `model` and /v1/models lists (default: the target as given)",
    "host": "address to listen on (0.0.0.0 for every interface)",
    "port": "port to listen on; 0 picks a free one (the address is printed on stderr)",
    "shutdown_timeout": "seconds the requests in flight get to finish after SIGTERM before they are aborted",
    "log_level": "uvicorn's and the server's log level",
}
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ServeConfig(EngineConfig):
    """The engine's options (EngineConfig) and the server's."""
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = False

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} is invalid: it must be an integer in [0, 65535] (0 picks a free one)")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} is invalid: it must be >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is invalid: choose one of {', '.join(LOG_LEVELS)}")


def add_arguments(parser) -> None:
    add_options(parser, ServeConfig, HELP, {**ENGINE_TYPES, "port": int, "shutdown_timeout": float}, {
        "config": {"metavar": "FILE"}, "speculative_config": {"metavar": "JSON"}, "dtype": {"choices": list(DTYPES)}, "weights": {"choices": list(WEIGHTS)},
        "log_level": {"choices": LOG_LEVELS}, "enable_prefix_caching": {"action": argparse.BooleanOptionalAction}})
    parser.add_argument("--access-log", dest="access_log", action="store_true", default=argparse.SUPPRESS,
                        help="log every HTTP request")
    parser.epilog = (
        "Endpoints: POST /v1/chat/completions, POST /v1/completions (stream: true for server-sent events), GET "
        "/v1/models, GET /health, GET /metrics (Prometheus, vLLM's vllm: names). Requests take OpenAI's sampling "
        "fields and vLLM's top_k, min_p, repetition_penalty, stop_token_ids and ignore_eos; an absent temperature is "
        "1.0, as OpenAI's. `usage.speculative` carries each request's acceptance.")


def run(args) -> None:
    import logging

    from serving.engine import Engine
    from serving.server.app import build_app

    config = ServeConfig(**merge_options(vars(args), [f.name for f in fields(ServeConfig)]))
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(config)
    model_name = config.served_model_name or config.target
    app = build_app(engine, model_name)
    listener = listen(config.host, config.port)
    host, port = listener.getsockname()[:2]
    # uvicorn's own deadline is only a backstop: the engine loop ends every request by shutdown_timeout itself, so
    # no handler is cancelled mid-response.
    uvicorn_config = uvicorn.Config(app, log_level=config.log_level, access_log=config.access_log,
                                    timeout_graceful_shutdown=config.shutdown_timeout + 10)
    server = DrainingServer(uvicorn_config, app.state.engine_loop, config.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it is done; these handlers make that a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    drafting = config.speculative_config.label() if config.speculative_config else "plain decoding"
    print(f"draftheads serve: {model_name} ({drafting}, {engine.block_manager.num_blocks} K/V blocks of "
          f"{engine.block_size}, max_model_len {engine.max_model_len}) on http://{host}:{port}", file=sys.stderr,
          flush=True)
    server.run(sockets=[listener])


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signal also starts the engine loop's drain."""

    def __init__(self, config: uvicorn.Config, engine_loop, drain_timeout: float):
        super().__init__(config)
        self.engine_loop, self.drain_timeout = engine_loop, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.drain(self.drain_timeout)
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts so that port 0 gives a known free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    listener.listen(2048)
    return listener
