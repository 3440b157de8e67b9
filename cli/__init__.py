"""The `hopline` command and the small Python client it uses; sits above everything else."""
