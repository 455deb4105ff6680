"""`kvserve advise`: why prefix caching misses in a request log, and what each fix would reach."""
