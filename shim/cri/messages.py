"""Records → CRI messages: PodSandbox, PodSandboxStatus, Container, ContainerStatus.

The pod and container entries of the List and Status answers and of container
events are built here from the shim's records, the same for every backend.
"""

from __future__ import annotations

from backends.contract import ContainerRecord, SandboxRecord, recorded_stop_signal
from cri_api import api_pb2 as pb


def sandbox_status_pb(sb: SandboxRecord) -> pb.PodSandboxStatus:
    cfg = sb.config
    st = pb.PodSandboxStatus(
        id=sb.id,
        metadata=cfg.metadata,
        state=sb.state,
        created_at=sb.created_at,
        runtime_handler=sb.handler,
    )
    if sb.status.ip:
        st.network.ip = sb.status.ip
        for ip in sb.status.additional_ips:
            st.network.additional_ips.add(ip=ip)
    ns = cfg.linux.security_context.namespace_options
    st.linux.namespaces.options.CopyFrom(ns)
    st.labels.update(cfg.labels)
    st.annotations.update(cfg.annotations)
    return st


def sandbox_pb(sb: SandboxRecord) -> pb.PodSandbox:
    cfg = sb.config
    out = pb.PodSandbox(
        id=sb.id, metadata=cfg.metadata, state=sb.state, created_at=sb.created_at, runtime_handler=sb.handler
    )
    out.labels.update(cfg.labels)
    out.annotations.update(cfg.annotations)
    return out


def image_spec_pb(c: ContainerRecord) -> pb.ImageSpec:
    spec = pb.ImageSpec()
    spec.CopyFrom(c.config.image)
    spec.image = c.image_name or c.config.image.image
    spec.user_specified_image = c.config.image.user_specified_image or c.config.image.image
    return spec


def container_pb(c: ContainerRecord) -> pb.Container:
    cfg = c.config
    out = pb.Container(
        id=c.id,
        pod_sandbox_id=c.sandbox_id,
        metadata=cfg.metadata,
        image=image_spec_pb(c),
        image_ref=c.image_ref,
        image_id=c.image_ref,
        state=c.state,
        created_at=c.created_at,
    )
    out.labels.update(cfg.labels)
    out.annotations.update(cfg.annotations)
    return out


def container_status_pb(c: ContainerRecord) -> pb.ContainerStatus:
    cfg = c.config
    s = c.status
    out = pb.ContainerStatus(
        id=c.id,
        metadata=cfg.metadata,
        state=s.state,
        created_at=c.created_at,
        started_at=s.started_at,
        finished_at=s.finished_at,
        exit_code=s.exit_code,
        image=image_spec_pb(c),
        image_ref=c.image_ref,
        image_id=c.image_ref,
        reason=s.reason,
        message=s.message,
        log_path=c.log_path,
        # What the runtime will stop it with: the kubelet shows it as the pod status' stopSignal.
        stop_signal=pb.Signal.Name(recorded_stop_signal(c)),
    )
    out.labels.update(cfg.labels)
    out.annotations.update(cfg.annotations)
    out.mounts.extend(cfg.mounts)
    volumes = c.image_volume_refs
    if volumes:  # which image each image volume is, by its digest
        for mnt in out.mounts:
            ref = volumes.get(mnt.container_path)
            if ref and mnt.HasField("image"):
                mnt.image.image_ref = ref
    if c.resources is not None:
        out.resources.CopyFrom(c.resources)
    elif cfg.linux.HasField("resources"):
        out.resources.linux.CopyFrom(cfg.linux.resources)
    sc = cfg.linux.security_context
    effective = c.effective_user
    if effective is not None:  # what the runtime resolved in the image
        user = out.user.linux
        user.uid = effective.uid
        user.gid = effective.gid
        user.supplemental_groups.extend(effective.groups)
    elif sc.HasField("run_as_user") or sc.HasField("run_as_group") or sc.supplemental_groups:
        user = out.user.linux
        user.uid = sc.run_as_user.value
        user.gid = sc.run_as_group.value
        user.supplemental_groups.extend(sc.supplemental_groups)
    return out
