"""The KServe v2 (Open Inference Protocol) gRPC messages the gateway serves.

Loadmaster does not generate its own Python code for the KServe protocol: it serves the
messages that the stock `tritonclient[grpc]` package ships (`grpc_service.proto` and
`model_config.proto`, package `inference`). Protobuf keeps one registry of symbols per
process, so a second copy of `inference.*` would make importing `tritonclient.grpc` next to
Loadmaster fail with "duplicate symbol 'inference.DataType'"; with one copy, a client,
a test or a tool can import both. `protos/kserve/` holds the subset of the protocol that
Loadmaster serves, for languages without a stock client; a test checks that it stays
wire-compatible with these descriptors (docs/clients.md).
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as inference_pb2
from tritonclient.grpc import service_pb2_grpc as inference_pb2_grpc

__all__ = ["SERVICE_NAME", "inference_pb2", "inference_pb2_grpc", "model_config_pb2"]

SERVICE_NAME: str = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
