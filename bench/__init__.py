"""`hopline bench`: the load generator and baselines behind every performance claim."""
