"""Weight sync between a node's trainer side and its engines (``engines.weight_sync``)."""
