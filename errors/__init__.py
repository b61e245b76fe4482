"""The errors a person has to act on, raised in every room: ConfigError, a config or an input that cannot work as
given; its message names the bad value and what to change, and trainer_pipe.py ends the run with the exit code that
no restart repeats (resilience/exit_codes.py)."""


class ConfigError(ValueError):
    """A config that cannot work; the message names the bad value and what to do."""
