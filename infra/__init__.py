"""Local infrastructure helpers (SeaweedFS S3 server, ...) used by tests and `make up`."""
