"""An app of `draftheads serve` run by a test: uvicorn in a thread of the test's process, on a free port of
127.0.0.1, stopped when the test is done with it (tests/serving/test_server.py, tests/training/test_endpoint.py)."""
from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from serving.server.serve import listen


@contextlib.contextmanager
def running(app):
    """`app` on uvicorn in a thread, on a free port; yields its base URL."""
    listener = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"
