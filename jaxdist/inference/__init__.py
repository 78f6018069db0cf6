"""Running a trained checkpoint: load it onto a mesh, generate text, score held-out data (``jaxdist.generate``, ``jaxdist.eval``)."""
