"""The `tilertc` command line."""

import json

import click
from rich.console import Console

from tilertc.ir.target import TARGETS, get_target
from tilertc.model_specs import SpecError, load_spec


@click.group()
@click.version_option(package_name="tilertc")
def main() -> None:
    """tilertc: compile an LLM's decode step into one persistent CUDA kernel."""


def parse_overrides(pairs: tuple[str, ...]) -> dict:
    """`KEY=VALUE` pairs; VALUE is read as JSON (numbers, true, null, lists) or else as text."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--set")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@main.command("inspect")
@click.argument("model")
@click.option("--target", type=click.Choice(sorted(TARGETS), case_sensitive=False),
              default="h200", show_default=True, help="GPU whose bandwidth sets the floor.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="KV-cache capacity, and the context at which KV reads are counted "
                   "[default: max positions, at most 4096].")
@click.option("--summary", is_flag=True, help="Show runs of identical layers once, with ×N.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON dict.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key before validation (repeatable).")
def inspect_command(model: str, target: str, max_seq_len: int | None, summary: bool,
                    as_json: bool, overrides: tuple[str, ...]) -> None:
    """Show the decode-step op graph of MODEL and the bytes each token reads.

    MODEL is a built-in name (e.g. llama-3.2-1b), a config.json, or a directory holding one.
    """
    from tilertc.inspect import inspect_model, print_inspection

    try:
        spec = load_spec(model, parse_overrides(overrides))
    except SpecError as e:
        raise click.ClickException(str(e)) from None
    if max_seq_len is not None and max_seq_len > spec.max_position_embeddings:
        raise click.BadParameter(f"{max_seq_len} exceeds the model's max_position_embeddings "
                                 f"{spec.max_position_embeddings}", param_hint="--max-seq-len")
    insp = inspect_model(spec, get_target(target), max_seq_len, summary)
    if as_json:
        click.echo(json.dumps(insp.to_dict(), indent=1, sort_keys=True))
    else:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
            console = Console(width=160)
        print_inspection(insp, console)
