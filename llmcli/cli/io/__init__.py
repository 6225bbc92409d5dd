"""JSONL records for the CLI: reading and checking input lines, writing and resuming output."""
