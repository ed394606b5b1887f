"""Generated protobuf and gRPC stubs. Never edit; run `make proto`."""
