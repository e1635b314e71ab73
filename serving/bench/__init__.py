"""Measurement: prompt sources, the offline bench, sweeps and their reports, bench-serve (a client of any OpenAI-compatible server). The engine never imports this package."""
