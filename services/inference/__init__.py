"""The inference service: runs model versions from the repository on a swappable backend."""
