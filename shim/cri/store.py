"""Records by ID, unique-prefix lookup, the name registrar, atomic JSON persistence.

Records live in memory and are written, one JSON file per record, under
``STATE_DIR/{sandboxes,containers}/ID.json``. A write goes to a temporary
file first and is renamed over the old one, so a SIGKILL at any moment
leaves either the old or the new record, never a torn one. No fsync: the
shim must survive its own death, and a node that loses power loses its
containers as well.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import dataclasses
import errno
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar, overload

import structlog

from backends.contract import (
    ContainerRecord,
    ContainerStatus,
    EffectiveUser,
    SandboxRecord,
    SandboxStatus,
    signal_by_name,
)
from cri_api import api_pb2 as pb
from shim.cri.errors import (
    AlreadyExistsError,
    CriError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

log = structlog.get_logger("store")

ID_RE = re.compile(r"^[0-9a-f]{64}$")
RECORD_VERSION = 1

R = TypeVar("R", SandboxRecord, ContainerRecord)


def new_id() -> str:
    return secrets.token_hex(32)


class Table(Generic[R]):
    """One kind of record: by full ID, with unique-prefix lookup."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._by_id: dict[str, R] = {}
        # Goes up at every change of the set of records or of one of them (Store).
        self.version = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._by_id.values()))

    def values(self) -> list[R]:
        return list(self._by_id.values())

    def keys(self) -> list[str]:
        return list(self._by_id)

    def get(self, full_id: str) -> R | None:
        return self._by_id.get(full_id)

    def add(self, record: R) -> None:
        self._by_id[record.id] = record
        self.version += 1

    def discard(self, full_id: str) -> None:
        if self._by_id.pop(full_id, None) is not None:
            self.version += 1

    @overload
    def find(self, ref: str, *, made: bool = False) -> R: ...

    @overload
    def find(self, ref: str, *, missing: Literal["none", "quiet"]) -> R | None: ...

    def find(
        self, ref: str, *, missing: Literal["error", "none", "quiet"] = "error", made: bool = False
    ) -> R | None:
        """The record whose ID is ``ref`` or starts with it (crictl users type short IDs).

        An empty or ambiguous ``ref`` is INVALID_ARGUMENT. None that matches is
        NOT_FOUND, or, with ``missing="none"``, None (idempotent Stop/Remove); with
        ``missing="quiet"`` an ambiguous ``ref`` is None too (a List filter that
        matches nothing). ``made``: a record whose creation is still under way
        (not committed, not listed) is NOT_FOUND too.
        """
        record = self._by_id.get(ref) or self._by_prefix(ref, missing)
        if made and record is not None and not record.committed:
            raise NotFoundError(f"{self.kind} {ref!r} not found")
        return record

    def _by_prefix(self, ref: str, missing: Literal["error", "none", "quiet"]) -> R | None:
        if not ref:
            raise InvalidArgumentError(f"{self.kind} ID must not be empty")
        found = [r for i, r in self._by_id.items() if i.startswith(ref)] if len(ref) < 64 else []
        if len(found) == 1:
            return found[0]
        if found:
            if missing == "quiet":
                return None
            raise InvalidArgumentError(
                f"{self.kind} ID prefix {ref!r} is ambiguous: it matches {len(found)} IDs"
            )
        if missing == "error":
            raise NotFoundError(f"{self.kind} {ref!r} not found")
        return None


class NameRegistrar:
    """Reserves unique names before anything is created; released on failure or removal."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._names: dict[str, str] = {}

    def reserve(self, name: str, owner: str) -> None:
        current = self._names.get(name)
        if current is not None and current != owner:
            raise AlreadyExistsError(f"{self.kind} name {name!r} is already reserved by {current}")
        self._names[name] = owner

    def release(self, name: str, owner: str) -> None:
        if self._names.get(name) == owner:
            del self._names[name]

    def owner(self, name: str) -> str | None:
        return self._names.get(name)


def sandbox_name(meta: pb.PodSandboxMetadata) -> str:
    # The same tuple the kubelet considers unique for a pod attempt.
    return f"{meta.name}_{meta.namespace}_{meta.uid}_{meta.attempt}"


def container_name(sandbox: SandboxRecord, meta: pb.ContainerMetadata) -> str:
    smeta = sandbox.config.metadata
    return f"{meta.name}_{smeta.name}_{smeta.namespace}_{smeta.uid}_{meta.attempt}"


# --------------------------------------------------------------------------- serialisation


def _b64(msg: Any) -> str:
    return base64.b64encode(msg.SerializeToString()).decode()


def _unb64(cls: Callable[[], Any], data: str) -> Any:
    msg = cls()
    msg.ParseFromString(base64.b64decode(data))
    return msg


def sandbox_to_json(r: SandboxRecord) -> dict[str, Any]:
    return {
        "v": RECORD_VERSION,
        "id": r.id,
        "handler": r.handler,
        "backend": r.backend,
        "config": _b64(r.config),
        "created_at": r.created_at,
        "ready": r.status.ready,
        "ip": r.status.ip,
        "additional_ips": list(r.status.additional_ips),
        "backend_data": r.backend_data,
        "committed": r.committed,
    }


def sandbox_from_json(d: dict[str, Any]) -> SandboxRecord:
    return SandboxRecord(
        id=d["id"],
        handler=d["handler"],
        backend=d["backend"],
        config=_unb64(pb.PodSandboxConfig, d["config"]),
        created_at=int(d["created_at"]),
        status=SandboxStatus(ready=bool(d["ready"]), ip=d["ip"], additional_ips=tuple(d["additional_ips"])),
        backend_data=dict(d.get("backend_data") or {}),
        committed=bool(d.get("committed")),
    )


def container_to_json(r: ContainerRecord) -> dict[str, Any]:
    s = r.status
    return {
        "v": RECORD_VERSION,
        "id": r.id,
        "sandbox_id": r.sandbox_id,
        "backend": r.backend,
        "config": _b64(r.config),
        "created_at": r.created_at,
        "log_path": r.log_path,
        "image_ref": r.image_ref,
        "image_name": r.image_name,
        "status": {
            "started_at": s.started_at,
            "finished_at": s.finished_at,
            "exit_code": s.exit_code,
            "reason": s.reason,
            "message": s.message,
            "pid": s.pid,
            "unknown": s.unknown,
        },
        "resources": _b64(r.resources) if r.resources is not None else None,
        "stop_signal": pb.Signal.Name(r.stop_signal) if r.stop_signal else "",
        "image_volume_refs": r.image_volume_refs,
        "effective_user": _user_to_json(r.effective_user),
        "backend_data": r.backend_data,
        "committed": r.committed,
    }


def _user_to_json(u: EffectiveUser | None) -> dict[str, Any] | None:
    return None if u is None else {"uid": u.uid, "gid": u.gid, "groups": list(u.groups)}


def _user_from_json(u: Any) -> EffectiveUser | None:
    if not isinstance(u, dict):
        return None
    return EffectiveUser(
        int(u.get("uid", 0)), int(u.get("gid", 0)), tuple(int(g) for g in u.get("groups") or ())
    )


def container_from_json(d: dict[str, Any]) -> ContainerRecord:
    s = d["status"]
    data = dict(d.get("backend_data") or {})
    if "stop_signal" not in d:
        # Written before these were fields: the backend kept them in its backend_data, where this
        # shim no longer looks. Moved out, so that an upgrade keeps what ContainerStatus reports.
        d = {
            **d,
            "stop_signal": data.pop("stop_signal", ""),
            "image_volume_refs": data.pop("image_volumes", {}),
            "effective_user": data.pop("user", None),
        }
    signal = d["stop_signal"]
    return ContainerRecord(
        id=d["id"],
        sandbox_id=d["sandbox_id"],
        backend=d["backend"],
        config=_unb64(pb.ContainerConfig, d["config"]),
        created_at=int(d["created_at"]),
        log_path=d["log_path"],
        image_ref=d.get("image_ref", ""),
        image_name=d.get("image_name", ""),
        status=ContainerStatus(
            started_at=int(s["started_at"]),
            finished_at=int(s["finished_at"]),
            exit_code=int(s["exit_code"]),
            reason=s["reason"],
            message=s["message"],
            pid=int(s.get("pid", 0)),
            unknown=bool(s.get("unknown")),
        ),
        resources=_unb64(pb.ContainerResources, d["resources"]) if d.get("resources") else None,
        # By name: SIGNAL_SIGTERM, or SIGTERM in a record written before the enum's renaming.
        stop_signal=signal_by_name(signal),
        image_volume_refs={str(k): str(v) for k, v in dict(d["image_volume_refs"] or {}).items()},
        effective_user=_user_from_json(d["effective_user"]),
        backend_data=data,
        committed=bool(d.get("committed")),
    )


class StateDir:
    """Atomic one-file-per-record persistence."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.quarantined: list[str] = []  # where records kept aside at load are
        self.sandboxes = os.path.join(root, "sandboxes")
        self.containers = os.path.join(root, "containers")
        for d in (self.sandboxes, self.containers):
            os.makedirs(d, mode=0o700, exist_ok=True)

    @staticmethod
    def write_atomic(path: str, data: bytes) -> None:
        """Write the file whole or not at all; a full disk is RESOURCE_EXHAUSTED naming the path.

        A record that exists is swapped with the new one (renameat2 RENAME_EXCHANGE) and
        the old one unlinked, rather than renamed over: on ext4 a rename over an existing
        file makes the kernel write the new file's data out first (auto_da_alloc), which
        took 250-350 us a record here, against 60-90 us, all on the event loop. A reader
        sees the old record or the new one, never neither; a crash between the swap and
        the unlink leaves the old one as ``.tmp``, which loading removes.
        """
        tmp = f"{path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            finally:
                os.close(fd)
            if _exchange(tmp, path):
                _unlink(tmp)
            else:
                os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            why = f"cannot record {path}: {exc.strerror or exc}"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhaustedError(why) from None
            raise InternalError(why) from None

    def save_runtime(self, data: dict[str, Any]) -> None:
        self.write_atomic(os.path.join(self.root, "runtime.json"), json.dumps(data).encode())

    def load_runtime(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.root, "runtime.json"), "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save_sandbox(self, r: SandboxRecord) -> None:
        self.write_atomic(
            os.path.join(self.sandboxes, r.id + ".json"), json.dumps(sandbox_to_json(r)).encode()
        )

    def save_container(self, r: ContainerRecord) -> None:
        self.write_atomic(
            os.path.join(self.containers, r.id + ".json"), json.dumps(container_to_json(r)).encode()
        )

    def delete_sandbox(self, sandbox_id: str) -> None:
        _unlink(os.path.join(self.sandboxes, sandbox_id + ".json"))

    def delete_container(self, container_id: str) -> None:
        _unlink(os.path.join(self.containers, container_id + ".json"))

    def load(self) -> tuple[list[SandboxRecord], list[ContainerRecord]]:
        sandboxes = list(self._read_all(self.sandboxes, sandbox_from_json))
        containers = list(self._read_all(self.containers, container_from_json))
        return sandboxes, containers

    def _read_all(self, folder: str, parse: Callable[[dict[str, Any]], R]) -> Iterator[R]:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".tmp"):
                # A write that was interrupted before its rename: the old file is authoritative.
                _unlink(path)
                continue
            if not name.endswith(".json") or not ID_RE.match(name[:-5]):
                continue
            try:
                with open(path, "rb") as f:
                    data = json.loads(f.read())
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                if data.get("v") != RECORD_VERSION:
                    raise ValueError(f"record version {data.get('v')!r}, this shim writes {RECORD_VERSION}")
                record = parse(data)
                if record.id != name[:-5]:
                    raise ValueError(f"the record is of {record.id!r}, not of its file name")
            except Exception as exc:  # a torn, truncated or foreign file: any way it can be wrong
                # Never refuse to start over one bad file; keep it aside for a human.
                self.quarantine(path, f"{type(exc).__name__}: {exc}")
                continue
            yield record

    def quarantine(self, path: str, why: str) -> None:
        """Move a record the shim cannot use to ``quarantine/`` (kept, never deleted) and say so."""
        folder = os.path.join(self.root, "quarantine")
        kept = os.path.join(folder, f"{os.path.basename(os.path.dirname(path))}-{os.path.basename(path)}")
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.path.exists(kept):
                kept += f".{time.time_ns()}"
            os.replace(path, kept)
        except OSError as exc:
            log.error("state.quarantine_failed", path=path, error=str(exc))
            kept = path
        log.error("state.record_quarantined", path=path, kept=kept, error=why)
        self.quarantined.append(kept)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False when ``b`` does not exist or the system cannot swap."""
    global _renameat2
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _renameat2 = None  # this kernel or filesystem cannot: plain renames from now on
        return False
    raise OSError(err, os.strerror(err), b)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Store:
    """All records of the shim, their name reservations and their persistence.

    **The one way a record changes.** Every RPC changes records through these
    methods and no other; each does its steps in this order, and an event about
    the change is published by the caller only after the method returned:

    ``add(record)``
        A new record: its file is written, then it is in the tables (and the
        index of its sandbox's containers). A disk that refuses the file raises
        (RESOURCE_EXHAUSTED when full) and nothing changed.
    ``update(record, **fields)``
        A change the client asked for: the record *as it will be* is written
        first; only then are the fields set on the record in memory. A disk that
        refuses raises, and the record is as it was. ``update(record)`` with no
        field rewrites it as it is: a check that the disk takes writes before an
        effect that could not be undone.
    ``record_effect(record, **fields)``
        A change that already happened in the runtime (an exit, a stop, a pod
        that lost its VM): the record in memory changes whatever the disk says,
        and its file is written now or, if the disk refuses, again every
        ``RETRY_SECONDS`` and before any later write, in order.
    ``remove(record)``
        Out of the tables, its name released, then its file deleted.

    Each of them also counts the change: ``record.revision`` and its table's
    ``version`` go up, which is how whatever was built from a record (the encoded
    answers of shim/cri/answers.py) knows it is stale. Names are reserved in
    ``sandbox_names``/``container_names`` before a record is added, by the caller,
    and released by ``remove``.
    """

    RETRY_SECONDS = 5.0

    def __init__(self, state: StateDir | None) -> None:
        self.state = state
        self.sandboxes: Table[SandboxRecord] = Table("pod sandbox")
        self.containers: Table[ContainerRecord] = Table("container")
        self.sandbox_names = NameRegistrar("pod sandbox")
        self.container_names = NameRegistrar("container")
        # sandbox ID -> IDs of its containers (a dict as an ordered set: oldest first, as the
        # List answers), for cascading stops/removes and filters.
        self.by_sandbox: dict[str, dict[str, None]] = {}
        # Records of effects that happened but that the disk refused (full): written
        # again, in order, as soon as it takes them (see record_effect).
        self._unsaved: dict[str, SandboxRecord | ContainerRecord] = {}
        self._retry: asyncio.TimerHandle | None = None

    def load(self) -> None:
        if self.state is None:
            return
        sandboxes, containers = self.state.load()
        # Tables keep insertion order, which List* answers follow: oldest first.
        sandboxes.sort(key=lambda r: r.created_at)
        containers.sort(key=lambda r: r.created_at)
        state = self.state
        for s in sandboxes:
            try:
                self.sandbox_names.reserve(sandbox_name(s.config.metadata), s.id)
            except AlreadyExistsError as exc:  # two records of one name: only a hand-made state dir
                state.quarantine(os.path.join(state.sandboxes, s.id + ".json"), str(exc))
                continue
            self._insert(s)
        for c in containers:
            sb = self.sandboxes.get(c.sandbox_id)
            if sb is None:
                log.warning("state.orphan_container", container_id=c.id, sandbox_id=c.sandbox_id)
            else:
                try:
                    self.container_names.reserve(container_name(sb, c.config.metadata), c.id)
                except AlreadyExistsError as exc:
                    state.quarantine(os.path.join(state.containers, c.id + ".json"), str(exc))
                    continue
            self._insert(c)

    # ---- the one write path
    def add(self, record: SandboxRecord | ContainerRecord) -> None:
        """A new record: disk, then memory; nothing changed if the disk refuses."""
        self._write(record)
        self._insert(record)

    def update(self, record: R, **fields: Any) -> None:
        """Disk (the record as it will be), then memory; nothing changed if the disk refuses."""
        self._write(dataclasses.replace(record, **fields) if fields else record)
        self._set(record, fields)

    def record_effect(self, record: R, **fields: Any) -> None:
        """Memory, whatever the disk says; then disk now or, if it refuses, later (in order)."""
        self._set(record, fields)
        try:
            self._save(record)
        except CriError as exc:
            kind = "sandbox_id" if isinstance(record, SandboxRecord) else "container_id"
            log.error("state.persist_failed", error=exc.message, will_retry=True, **{kind: record.id})
            self._unsaved[record.id] = record
            self._arm_retry()

    def remove(self, record: SandboxRecord | ContainerRecord) -> None:
        """Memory (tables, index, name), then the file."""
        self._unsaved.pop(record.id, None)
        if isinstance(record, SandboxRecord):
            self.sandboxes.discard(record.id)
            self.sandbox_names.release(sandbox_name(record.config.metadata), record.id)
            if not self.by_sandbox.get(record.id):
                self.by_sandbox.pop(record.id, None)
            if self.state is not None:
                self.state.delete_sandbox(record.id)
            return
        self.containers.discard(record.id)
        sb = self.sandboxes.get(record.sandbox_id)
        if sb is not None:
            self.container_names.release(container_name(sb, record.config.metadata), record.id)
        ids = self.by_sandbox.get(record.sandbox_id)
        if ids is not None:
            ids.pop(record.id, None)
        if self.state is not None:
            self.state.delete_container(record.id)

    def containers_of(self, sandbox_id: str) -> list[ContainerRecord]:
        out = []
        for cid in self.by_sandbox.get(sandbox_id, ()):
            c = self.containers.get(cid)
            if c is not None:
                out.append(c)
        return out

    # ---- its steps
    def _insert(self, record: SandboxRecord | ContainerRecord) -> None:
        if isinstance(record, SandboxRecord):
            self.sandboxes.add(record)
            self.by_sandbox.setdefault(record.id, {})
        else:
            self.containers.add(record)
            self.by_sandbox.setdefault(record.sandbox_id, {})[record.id] = None

    def _set(self, record: SandboxRecord | ContainerRecord, fields: dict[str, Any]) -> None:
        for name, value in fields.items():
            setattr(record, name, value)
        record.revision += 1
        table = self.sandboxes if isinstance(record, SandboxRecord) else self.containers
        table.version += 1

    def _write(self, record: SandboxRecord | ContainerRecord) -> None:
        """Persist ``record`` after what the disk refused earlier (RESOURCE_EXHAUSTED on a full disk)."""
        if self._unsaved:
            self.retry_unsaved()
        self._save(record)

    def _save(self, record: SandboxRecord | ContainerRecord) -> None:
        if self.state is None:
            return
        if isinstance(record, SandboxRecord):
            self.state.save_sandbox(record)
        else:
            self.state.save_container(record)

    # ---- effects the disk refused
    def _arm_retry(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a unit test): the next write retries
        self._retry = loop.call_later(self.RETRY_SECONDS, self._retry_fired)

    def _retry_fired(self) -> None:
        self._retry = None
        self.retry_unsaved()

    def retry_unsaved(self) -> bool:
        """Write the records the disk refused earlier; whether none is left unsaved."""
        while self._unsaved:
            rid, r = next(iter(self._unsaved.items()))
            table = self.sandboxes if isinstance(r, SandboxRecord) else self.containers
            if table.get(rid) is r:  # still current (not removed meanwhile)
                try:
                    self._save(r)
                except CriError:
                    self._arm_retry()
                    return False
                log.info("state.persisted_late", id=rid)
            del self._unsaved[rid]
        return True

    def unsaved_ids(self) -> list[str]:
        return list(self._unsaved)

    def close(self) -> None:
        """Stop retrying (the shim is stopping)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
