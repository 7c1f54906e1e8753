"""Loadmaster shared library: config, errors, tensors, framing, gRPC helpers, telemetry."""
