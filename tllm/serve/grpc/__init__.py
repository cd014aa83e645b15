"""tllm's gRPC API: tllm.proto and its generated stubs (tllm_pb2, tllm_pb2_grpc)."""
