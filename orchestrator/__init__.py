"""rollcall's control plane: configuration, the database layer, services and the CLI.

Importing this package is cheap: nothing here imports torch, ray or SQLAlchemy at module
level, so ``rollcall --help`` stays fast.
"""

__version__ = "0.1.0"
