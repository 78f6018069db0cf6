"""Parallel schedules beyond sharding rules (pipeline over the pipe axis)."""
