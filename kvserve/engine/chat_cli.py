"""`kvserve chat`: the module the CLI dispatcher loads (see kvserve.engine.cli)."""

from kvserve.engine.cli import add_chat_arguments as add_arguments  # noqa: F401
from kvserve.engine.cli import run_chat as run  # noqa: F401
