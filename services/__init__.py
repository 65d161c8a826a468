"""specvox's gRPC services, Redis adapters and command line."""
