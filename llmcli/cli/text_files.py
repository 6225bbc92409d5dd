"""Reading a small text file the user names (--config, --chat-template): UTF-8, or UTF-16/32 with a BOM."""
from __future__ import annotations

import codecs
from pathlib import Path

# Editors on Windows save "Unicode" as UTF-16 with a byte-order mark; the mark says which encoding it is.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


class TextFileError(ValueError):
    """The file cannot be read as text; the message names it and says what to do."""


def read_text(path: Path | str, what: str) -> str:
    """The text of ``path``; ``what`` names it in the error (``--config x.toml``)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TextFileError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise TextFileError(f"{what}: not {encoding.split('-sig')[0].upper()} text (byte {exc.start + 1} is "
                            f"{data[exc.start:exc.start + 1]!r}); save it as UTF-8") from None
