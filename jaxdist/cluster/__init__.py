"""Processes: jax.distributed, the local and elastic launchers, supervision, liveness (death signals, heartbeats)."""
