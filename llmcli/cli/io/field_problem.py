"""FieldProblem: the error of one record field, raised by every parser of input records."""
from __future__ import annotations

class FieldProblem(ValueError):
    """A record field is missing or wrong; carries the dotted field name."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field_name
        self.message = message
