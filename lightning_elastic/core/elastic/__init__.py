"""What elastic resumes need beyond tensors: the data position of an epoch and RNG streams."""
