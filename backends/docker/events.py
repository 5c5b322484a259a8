"""The engine's event stream: exits nobody asked for, reported once, with the OOM race settled."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from backends.contract import ExitInfo
from backends.contract.errors import CriError, NotFoundError

from . import labels as lbl
from .context import Shared, exit_info
from .engine_api import engine_time
from .state import ContainerState, Tracked

_EXIT_RECHECK = 1.0  # s between looks at a container that died while the engine did not answer
# Every image event that changes what the engine lists (a push adds a repo digest, a
# container's commit makes an image), and the container deaths.
_FILTERS = {
    "type": ["container", "image"],
    "event": ["die", "oom", "commit", "tag", "untag", "delete", "pull", "push", "import", "load"],
}


class EventWatcher:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def watch(self) -> None:
        """Follow the engine's events; reconnect (catching up) when dockerd comes back.

        Container deaths become exits; image changes go to the image mirror,
        which is only trusted while this stream is connected.
        """
        shared = self._shared
        since: int | None = None
        while not shared.closed:
            try:
                resp = await shared.engine.events(_FILTERS, None if since is None else engine_time(since))
            except CriError:
                await asyncio.sleep(1)
                continue
            shared.engine_images.mirror.connected()
            # Anything that died while we were not listening.
            shared.spawn(self._check_watched())
            try:
                async for ev in resp.json_lines():
                    since = int(ev.get("timeNano") or time.time_ns())
                    action = ev.get("Action", ev.get("status"))
                    if ev.get("Type") == "image" or action == "commit":
                        shared.engine_images.mirror.changed()
                        continue
                    attrs = (ev.get("Actor") or {}).get("Attributes") or {}
                    cri_id = attrs.get(lbl.ID, "")
                    if attrs.get(lbl.INSTANCE) != shared.instance or not cri_id:
                        continue
                    st = shared.states.get(cri_id)
                    if st is None:
                        continue
                    if action == "oom":
                        if isinstance(st, ContainerState):
                            st.oom = True
                    elif not st.stopping and st.watched:
                        shared.spawn(self.report_exit(st, died=True))
                    elif not st.stopping:
                        st.died = True  # its start has yet to watch it: the start looks at this
            finally:
                resp.close()
                shared.engine_images.mirror.disconnected()
            await asyncio.sleep(0.2)

    async def _check_watched(self) -> None:
        for st in self._shared.states.watched():
            await self.report_exit(st, died=False)

    async def report_exit(self, st: Tracked, died: bool = True) -> None:
        """Report the end of a watched container or sandbox, once, if it has ended.

        ``died``: the engine said so (an event, or a start that found it
        exited); its state may lag a moment behind. Otherwise this is a check
        of something that may well be running.
        While the engine cannot be asked, the object stays watched and is
        looked at again every second (and when the event stream reconnects).
        """
        events = self._shared.events
        if not st.watched or st.stopping or st.reporting or events is None:
            return
        st.reporting = True
        try:
            for _ in range(5 if died else 1):
                try:
                    state = (await self._shared.engine.inspect_container(st.engine_id))["State"]
                except NotFoundError:
                    state = {"Running": False, "ExitCode": 137, "Error": "container vanished from the engine"}
                except CriError:
                    if not st.retrying:
                        st.retrying = True
                        self._shared.spawn(self._report_exit_later(st))
                    return
                if not state.get("Running"):
                    break
                if died:
                    await asyncio.sleep(0.05)  # a die event can come before the engine's state says so
            else:
                return
            if not st.watched or st.stopping:
                return  # stopped on request meanwhile: its exit is reported there
            st.watched = False
            if not isinstance(st, ContainerState):
                events.sandbox_not_ready(st.cri_id, "pause container exited")
                return
            if st.process is not None:
                st.process.stopped()  # the rest of the output is read while the OOM race settles
            info = await self._exit_of(st, state)
            if st.process is not None:
                st.process.exited(info)
            else:
                st.exit = info  # recovered, and not followed yet: its process starts ended
        finally:
            st.reporting = False

    async def _report_exit_later(self, st: Tracked) -> None:
        await asyncio.sleep(_EXIT_RECHECK)
        st.retrying = False
        await self.report_exit(st, died=False)

    async def _exit_of(self, st: ContainerState, state: dict[str, Any]) -> ExitInfo:
        """How it ended, OOM included: the engine's OOMKilled flag loses a race
        with the exit when the OOM event comes second, the oom event does not."""
        info = exit_info(state)
        if info.exit_code == 137 and info.reason != "OOMKilled":
            for _ in range(4):
                if st.oom:
                    break
                await asyncio.sleep(0.05)
            if st.oom:
                info = dataclasses.replace(info, reason="OOMKilled")
        st.oom = False
        return info
