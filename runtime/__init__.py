"""The shared runtime every service stands on: config, server, interceptors, batcher, tensors,
errors, the service table and the mesh launcher. It imports nothing above it (no service, no
model, no cache, no CLI), so a process loads only what its own service needs.
"""
