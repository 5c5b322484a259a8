"""A CRI container config and its image, as the neutral container description the guest
agent turns into an OCI config (``messages.ContainerSpec``)."""

from __future__ import annotations

import json

from backends import contract
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.images.store import Image
from cri_api import api_pb2 as pb


def resources(res: pb.LinuxContainerResources) -> m.ContainerLimits:
    return m.ContainerLimits(
        cpu_quota=res.cpu_quota,
        cpu_period=res.cpu_period,
        cpu_shares=res.cpu_shares,
        memory=res.memory_limit_in_bytes,
        oom_score_adj=res.oom_score_adj,
    )


def process_spec(
    cfg: pb.ContainerConfig, img: Image, rootfs: m.Rootfs, mounts: list[m.Mount]
) -> m.ContainerSpec:
    """The neutral container description the agent turns into an OCI config."""
    icfg = img.config
    entry = list(cfg.command) or list(icfg.get("Entrypoint") or [])
    if cfg.args:
        cmd = list(cfg.args)
    elif cfg.command:
        cmd = []  # an explicit command drops the image's Cmd, as the kubelet expects
    else:
        cmd = list(icfg.get("Cmd") or [])
    args = entry + cmd
    if not args:
        raise errors.InvalidArgumentError("no command given and the image has none")
    env = [str(e) for e in icfg.get("Env") or []]
    keys = {kv.key for kv in cfg.envs}
    env = [e for e in env if e.split("=", 1)[0] not in keys] + [
        f"{kv.key}={kv.value.decode(errors='replace')}" for kv in cfg.envs
    ]
    sc = cfg.linux.security_context
    uid: int | None = None
    gid: int | None = None
    user_name = group_name = ""
    if sc.HasField("run_as_user"):
        uid = sc.run_as_user.value
    elif sc.run_as_username:
        user_name = sc.run_as_username
    else:
        image_user = str(icfg.get("User") or "")
        name, _, group = image_user.partition(":")
        if name.isdigit():
            uid = int(name)
        else:
            user_name = name
        if group.isdigit():
            gid = int(group)
        else:
            group_name = group
    if sc.HasField("run_as_group"):
        gid = sc.run_as_group.value
    return m.ContainerSpec(
        args=args,
        rootfs=rootfs,
        env=env,
        cwd=cfg.working_dir or str(icfg.get("WorkingDir") or "/"),
        user=m.User(uid=uid, name=user_name, gid=gid, group=group_name),
        supplemental_groups=list(sc.supplemental_groups),
        groups_policy="strict" if sc.supplemental_groups_policy == pb.Strict else "merge",
        tty=cfg.tty,
        stdin=cfg.stdin,
        stdin_once=cfg.stdin_once,
        privileged=sc.privileged,
        readonly_rootfs=sc.readonly_rootfs,
        no_new_privs=sc.no_new_privs,
        seccomp=_seccomp(sc),
        pid_mode={pb.POD: "pod", pb.NODE: "node", pb.TARGET: "target"}.get(
            sc.namespace_options.pid, "container"
        ),
        pid_target=sc.namespace_options.target_id if sc.namespace_options.pid == pb.TARGET else "",
        masked_paths=list(sc.masked_paths),
        readonly_paths=list(sc.readonly_paths),
        add_caps=["CAP_" + c.upper().removeprefix("CAP_") for c in sc.capabilities.add_capabilities],
        drop_caps=["CAP_" + c.upper().removeprefix("CAP_") for c in sc.capabilities.drop_capabilities],
        resources=resources(cfg.linux.resources),
        mounts=mounts,
    )


def _seccomp(sc: pb.LinuxContainerSecurityContext) -> m.Seccomp | None:
    """The container's seccomp for the agent: None (unconfined), the runtime default, or a profile."""
    choice = contract.seccomp_of(
        sc.seccomp if sc.HasField("seccomp") else None, sc.seccomp_profile_path, sc.privileged
    )
    if choice.kind == "unconfined":
        return None
    if choice.kind == "default":
        return m.Seccomp(default=True)
    return m.Seccomp(profile=json.loads(choice.profile))
