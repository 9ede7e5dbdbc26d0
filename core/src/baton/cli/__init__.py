"""baton's command line: ``baton.cli.main`` builds it, plugins add subcommands."""

from baton.cli.main import add_engine_arguments, engine_overrides

__all__ = ["add_engine_arguments", "engine_overrides"]
