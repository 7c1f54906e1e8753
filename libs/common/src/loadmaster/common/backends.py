"""Which model backends generate (text, token by token) rather than answer tensors.

The gateway sends these a generation (docs/generative.md) and the scheduler publishes where
they are served so gateways can place generations themselves (docs/generation-scheduling.md).
"""

from __future__ import annotations

__all__ = ["GENERATIVE_BACKENDS"]

GENERATIVE_BACKENDS = frozenset(
    {"transformers", "transformers_vlm", "openai_process", "remote_openai", "python_generative"}
)
