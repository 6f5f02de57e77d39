"""Generation paths that are not the serving path: a greedy loop and a pure functional generate."""
