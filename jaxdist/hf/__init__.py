"""Hugging Face models in and out (mappings, files), and running a checkpoint (generation, evaluation)."""
