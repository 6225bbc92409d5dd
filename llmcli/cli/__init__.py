"""The `llmcli` command-line tool: the Typer app, its three commands, progress, the run loop and the JSONL io."""
