"""The model repository, the torch-free MiniLM build and the pieces services share."""
