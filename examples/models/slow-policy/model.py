"""`slow-policy`: state [B, 32] -> action [B, 8] (tanh of the first 8 values), 10 ms per call."""

from __future__ import annotations

import time

import numpy as np

CALL_S = 0.010


class SlowPolicy:
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(CALL_S)  # the same for one row or eight
        return {"action": np.tanh(inputs["state"][:, :8]).astype(np.float32)}
