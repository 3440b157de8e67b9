"""The `hopline` command; it sits above everything else and imports each tool only when run."""
