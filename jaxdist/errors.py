"""Errors that reach the user as one line on stderr and exit code 2."""

import argparse


class JaxdistError(Exception):
    """Bad input from the user: a config, mesh, path or shape that cannot work."""


class ConfigError(JaxdistError):
    """A config file, key or value is wrong."""


class MeshError(JaxdistError):
    """A mesh spec is malformed or does not fit the devices or the model."""


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; the run stops (exit code ``EXIT_NONFINITE``)."""

    exit_code = 3


EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3  # the loss went NaN/inf and the run stopped


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors become a JaxdistError: one line and exit 2, like every other bad input."""

    def error(self, message: str) -> None:
        raise JaxdistError(message)
