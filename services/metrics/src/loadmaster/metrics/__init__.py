"""Loadmaster metrics service: ring-buffer windows, stats and Prometheus exposition of the
samples every service reports. `python -m loadmaster.metrics` runs it; `server.build` wires it."""
