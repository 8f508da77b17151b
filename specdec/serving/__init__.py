"""gRPC plumbing the three services share: error mapping, model worker thread, server factory."""
