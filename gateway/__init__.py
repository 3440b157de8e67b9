"""The gateway: the mesh's front door, orchestrating the other services (a star, not a chain)."""
