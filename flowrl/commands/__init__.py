"""Implementations of the command-line subcommands, imported lazily by flowrl.cli."""
