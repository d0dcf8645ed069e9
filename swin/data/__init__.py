"""Datasets, transforms and loaders that deliver normalised batches on the training device."""
