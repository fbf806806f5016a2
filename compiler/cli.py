"""The `tilertc` command line."""

import click


@click.group()
@click.version_option(package_name="tilertc")
def main() -> None:
    """tilertc: compile an LLM's decode step into one persistent CUDA kernel."""
