"""An asyncio interpreter for the POSIX sh subset that Kubernetes docs and e2e test pods use.

Why: a fake container has to *run* its command (``sh -c 'echo hi; sleep 3600'``, ``trap 'exit 0'
TERM; sleep infinity & wait``, a probe's ``cat /tmp/healthy``) without a process, a host file or a
real clock. :func:`run` takes the container's argv and :func:`run_script` a script; both parse once
into a small syntax tree and evaluate it with coroutines, so output reaches the caller as it is
produced and an idle ``while true; do sleep 1; done`` is one sleeping coroutine.

The caller provides, in :class:`ShellIO`: the container's files (an ``Fs``; :class:`MemoryFs` is a
ready one), its environment, stdin/stdout/stderr callables, an :class:`asyncio.Event` that delivers
the container's stop signal (``term_signal``, TERM unless told), an injectable ``sleep`` and
``clock``, a ``Network`` whose ports ``httpd`` listens on (none: it cannot), the ``Privileges`` its
processes have (uid, capabilities), and extra commands. An
extra command is a ``Command``: ``async def cmd(argv: list[str], io: ShellIO) -> int``, where
``argv[0]`` is the name as invoked and ``io`` is a copy of the caller's ShellIO bound to the
command's (redirected) stdin, stdout and stderr, its environment (exported variables and ``X=1 cmd``
assignments) and the shell's working directory; its result is the exit status. Names are looked up
as: the shell's own builtins (``cd``, ``export``, ``trap``, ``read``, ``wait``...), functions, extra
commands, built-in tools (``echo``, ``cat``, ``grep``...), then shell scripts in ``io.fs`` (by path
or on ``PATH``); ``/usr/bin/NAME`` finds the extra command or tool ``NAME``.

Signals: the container's main shell (the outermost one, or the one ``exec``-ed into) takes the stop
signal. Setting ``io.term`` interrupts its current ``sleep``, ``wait`` or blocking read; the shell
clears the event as it takes the signal (setting it again delivers another), runs the signal's trap
and continues after the interrupted command, or with no trap ends with 128 + its number (143 for
TERM; one that by default does not end a process, such as WINCH, is then ignored). An ``exit`` in
the trap ends the run with that code. Background jobs are not signalled; they are stopped when the run ends.
With ``io.init`` the main shell is PID 1 of its PID namespace, as a container's command is: the
kernel gives it only the signals it handles, so a signal with no trap (the stop signal included) is
ignored, and its caller's KILL after the stop timeout ends it (137). ``kill`` follows the same rule:
a job's ``kill $$``, and an exec's ``kill SIG 1`` (``io.kill_init``: its caller queues the signal
in the main shell's ``io.sent`` and sets its ``io.term``).

Known gaps, on purpose: no file-name globbing, ``[[``, arrays, aliases, ``getopts``, job control,
``sed``/``cut``/``uniq`` (``awk`` prints fields, no more), networking tools but ``httpd`` and the
servers of ``agnhost`` (the Kubernetes e2e image's tool, :mod:`.tools.agnhost`; add others as extra
commands),
``tail -f`` following (it prints, then waits), ``$LINENO``, ``${x/a/b}``. ``set -u``, ``-f``, ``-v``
and ``-n`` are accepted and ignored; ERR/DEBUG traps are accepted and never run; ``kill`` from a
background job only delivers SIGTERM to the shell.

The package, one module a part, each importing only modules listed before it:

- :mod:`.fs` the container's files (``Fs``, ``MemoryFs``); :mod:`.caller` what a run is given
  (``ShellIO``, ``Command``, ``Network``); :mod:`.http` HTTP/1.x on a ``Network``'s connection;
- :mod:`.syntax` the syntax tree, :mod:`.lexer` text to tokens, :mod:`.parser` tokens to the tree;
- :mod:`.control` early exits and errors, :mod:`.streams` descriptors and pipes;
- :mod:`.words` field splitting, :mod:`.patterns` shell patterns and regular expressions,
  :mod:`.arithmetic` ``$((...))``;
- :mod:`.process` one shell's state, lifecycle, signals and descriptors; :mod:`.expansion` words
  expanded; :mod:`.redirection` redirections opened; :mod:`.evaluation` commands run and looked up;
- :mod:`.options` option parsing, :mod:`.builtins` the special builtins, :mod:`.tools` the programs;
- :mod:`.entry` ``run``, ``run_script`` and ``knows``; it fills the evaluator's tables of builtins
  and tools, which the evaluator cannot import.
"""

from backends.fake.shell.caller import Connection, Network, Privileges, Serve, ShellIO
from backends.fake.shell.entry import knows, run, run_script
from backends.fake.shell.fs import MemoryFs

__all__ = [
    "Connection",
    "MemoryFs",
    "Network",
    "Privileges",
    "Serve",
    "ShellIO",
    "knows",
    "run",
    "run_script",
]
