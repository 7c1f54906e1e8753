"""Loadmaster shared library: config, errors, tensors, framing, gRPC helpers, telemetry."""

import os

# gRPC's fork support resets its c-ares DNS resolvers around every fork(); a resolver in use on
# another thread at that moment aborts the whole process (`ares_resolver.cc: Check failed:
# channel_ != nullptr`; grpc/grpc#41975), seen when the gateway started its gRPC relay while its
# scheduler session connected. Loadmaster's processes fork only to exec another program (the
# relay, engine processes, the launcher's services) and never use gRPC in a forked child, so
# the support is off unless a deployment sets it. This runs before `grpc` is imported: every
# service's entry point imports `loadmaster.common` first.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
