"""Shared observability for every hopline service: structured logs and tracing."""
