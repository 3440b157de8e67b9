"""hopline: a gRPC microservice mesh for real-time inference with a semantic cache."""

__version__ = "0.1.0"
