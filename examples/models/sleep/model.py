"""`sleep`: sleeps for the milliseconds in input `ms` (float32 scalar or [1]), echoes its inputs."""

from __future__ import annotations

import time

import numpy as np

from loadmaster.common.errors import InvalidArgumentError

MAX_SLEEP_MS = 60_000.0


class Sleep:
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ms = inputs["ms"]  # presence and dtype are checked against config.yaml before this runs
        if ms.size != 1:
            raise InvalidArgumentError(f"tensor 'ms': one value expected, got shape {list(ms.shape)}")
        delay_ms = float(ms.reshape(()))
        if not 0.0 <= delay_ms <= MAX_SLEEP_MS:
            raise InvalidArgumentError(f"tensor 'ms': {delay_ms} is outside [0, {MAX_SLEEP_MS:.0f}]")
        time.sleep(delay_ms / 1000.0)
        return {key: np.array(value) for key, value in inputs.items()}
