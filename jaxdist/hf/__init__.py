"""Hugging Face models in and out: the config and tensor mappings (Llama, Mixtral), the files, import and export."""
