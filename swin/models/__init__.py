"""The Swin network: blocks, window attention backends, window geometry, named configs, weights."""
