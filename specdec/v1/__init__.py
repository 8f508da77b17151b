"""Generated gRPC stubs for the `specdec.v1` proto package (made by `make protos`)."""
