"""jaxdist: JAX-native distributed training (data, FSDP/ZeRO, tensor parallel on one mesh).

Importing the package does not import JAX, so the CLI can set XLA flags (fake CPU
devices) before the backend starts.
"""

__version__ = "0.1.0"
