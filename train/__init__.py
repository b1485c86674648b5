"""ctxtrain: fine-tune diffusers video and image transformers under context parallelism."""
