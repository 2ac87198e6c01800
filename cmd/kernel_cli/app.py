"""The `kernel` typer app and its entry point."""
from __future__ import annotations

import typer

app = typer.Typer(name="kernel", no_args_is_help=True, add_completion=False)


def main() -> None:
    app()
