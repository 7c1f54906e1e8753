"""Loadmaster Python client SDK."""

from loadmaster.client._protocol import CurveKeys, NoReplyError
from loadmaster.client.aio import AsyncConnection, AsyncModel
from loadmaster.client.edge import Connection, Model, raise_for_error
from loadmaster.client.gpu_lease import AsyncGpuLease, GpuLease, LeaseLostError
from loadmaster.client.metrics import MetricSample, MetricSubscription, on_metric

__all__ = [
    "AsyncConnection",
    "AsyncGpuLease",
    "AsyncModel",
    "Connection",
    "CurveKeys",
    "GpuLease",
    "LeaseLostError",
    "MetricSample",
    "MetricSubscription",
    "Model",
    "NoReplyError",
    "on_metric",
    "raise_for_error",
]
