"""specvox's engine and stage logic: plain Python, no gRPC and no Redis."""
