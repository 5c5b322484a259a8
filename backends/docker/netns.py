"""TCP connections made inside another process's network namespace.

Port-forward must reach ``localhost:PORT`` of the pod, which only exists in
the pod's network namespace. Instead of running nsenter/socat, a dedicated
thread enters that namespace with setns(2), creates the socket there, and
returns: a socket stays in the namespace it was created in, so it can be
connected and used from anywhere afterwards. The thread switches back at
once; if it ever could not, it is retired so no other work runs in the
wrong namespace.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
import socket
import threading

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_setns.restype = ctypes.c_int


def _enter(fd: int) -> None:
    if _setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NetnsSocketFactory:
    """Makes sockets in the network namespace of a process, from one helper thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor = self._new_executor()

    @staticmethod
    def _new_executor() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="netns")

    def _make(self, pid: int, family: int) -> socket.socket:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _enter(target)
            finally:
                os.close(target)
            try:
                return socket.socket(family, socket.SOCK_STREAM)
            finally:
                try:
                    _enter(home)
                except OSError:
                    # Never let this thread serve another request from inside a pod.
                    with self._lock:
                        old, self._executor = self._executor, self._new_executor()
                    old.shutdown(wait=False)
                    raise
        finally:
            os.close(home)

    def submit(self, pid: int, family: int = socket.AF_INET) -> concurrent.futures.Future[socket.socket]:
        with self._lock:
            return self._executor.submit(self._make, pid, family)

    def close(self) -> None:
        self._executor.shutdown(wait=False)
