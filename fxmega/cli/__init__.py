"""The command line: one parser per command (``parser``) and the commands (``commands``)."""

from fxmega.cli.commands import main
from fxmega.cli.parser import config_from_args, parse_args

__all__ = ["config_from_args", "main", "parse_args"]
