"""Subcommands of the ``ortbatch`` CLI, one module each (see :mod:`ortbatch.cli`)."""
