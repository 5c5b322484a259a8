"""The shell's programs: what a container's image would have in /bin, written here over the
container's files and streams. Each module gives its own; this table holds them all."""

from __future__ import annotations

from backends.fake.shell.evaluation import Builtin
from backends.fake.shell.tools import (
    agnhost,
    awk,
    conditions,
    dump,
    files,
    httpd,
    printing,
    security,
    sh,
    system,
    text,
)

COMMANDS: dict[str, Builtin] = {
    **printing.COMMANDS,
    **text.COMMANDS,
    **conditions.COMMANDS,
    **system.COMMANDS,
    **security.COMMANDS,
    **files.COMMANDS,
    **sh.COMMANDS,
    **httpd.COMMANDS,
    **agnhost.COMMANDS,
    **awk.COMMANDS,
    **dump.COMMANDS,
}
