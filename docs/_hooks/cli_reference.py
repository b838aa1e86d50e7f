"""MkDocs hook: the CLI reference page is typer's own documentation of the `replay` app, generated at build time
from the commands (their docstrings and options' help), so it cannot drift from `replay COMMAND --help`."""

MARKER = "<!-- the replay commands -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    import typer
    from typer.cli import get_docs_for_click

    from replaybisect.cli import app

    command = typer.main.get_command(app)
    generated = get_docs_for_click(obj=command, ctx=typer.Context(command, info_name="replay"), name="replay")
    return markdown.replace(MARKER, generated.split("\n", 1)[1] if generated.startswith("# ") else generated)
