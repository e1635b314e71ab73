"""`draftheads serve`: an OpenAI-compatible HTTP server over the engine (serve.py the command, app.py the routes,
loop.py the engine thread, protocol.py the request bodies, metrics.py Prometheus, detokenizer.py streamed text)."""
