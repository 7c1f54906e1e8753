"""gRPC server reflection in both protocol versions, `v1alpha` and `v1`.

grpcio-reflection serves only `grpc.reflection.v1alpha.ServerReflection`; clients that speak
`grpc.reflection.v1` (current grpcurl, Postman, grpc-js and Go tooling) get UNIMPLEMENTED from
it. The two versions' messages are the same on the wire (v1 renamed the package and changed
nothing else), so the v1 service is the library's own servicer behind a handler registered
under the v1 name, decoding and encoding with the v1alpha message classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

__all__ = ["V1ALPHA_SERVICE_NAME", "V1_SERVICE_NAME", "enable_reflection"]

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (and both reflection services) in both versions."""
    names = [*service_names, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
