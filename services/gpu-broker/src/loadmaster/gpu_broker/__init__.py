"""Loadmaster gpu-broker: GPU inventory and memory leases in Redis, changed only by atomic
Lua scripts. `server.build(settings)` wires the gRPC service; `LeaseManager` is the core;
`leases` holds the domain values and the pure placement math. See README.md."""
