"""The train state, the step composed from its parts, the loop, checkpoints and resume, one run as a library."""
