"""`kvserve generate`: the module the CLI dispatcher loads (see kvserve.engine.cli)."""

from kvserve.engine.cli import add_generate_arguments as add_arguments  # noqa: F401
from kvserve.engine.cli import run_generate as run  # noqa: F401
