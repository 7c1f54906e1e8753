"""Loadmaster model-pool service: model slots on this worker's devices, a ZMQ data
port for inference, the `ModelPool` gRPC service and a session to the scheduler."""
