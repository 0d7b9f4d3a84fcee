"""Storage: object stores (local, S3), artifact keys and models, the checkpoint store."""
