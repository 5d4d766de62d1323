"""Generated protobuf modules (compiled from ../../proto/*.proto at build time)."""
