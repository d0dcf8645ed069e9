"""JPEG decoding (nvJPEG), augmentation kernels and the batch ring of the data.decode=gpu path."""
