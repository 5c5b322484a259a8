"""The cluster's CA, certificates, service-account keys and kubeconfigs, as kubeadm lays them out.

Made with the `openssl` command line (Debian's OpenSSL 3): the project's venv has no X.509 library
and this is test scaffolding, so it adds no dependency for it; every certificate is two plain
commands (a key and request, then the CA's signature with an extension file), which an operator
can read and run by hand. Keys are RSA 2048, as kubeadm's; certificates last a year.

- ``ca``: the cluster CA (clients and servers, kubelets' client certificates, the root CA pods see);
- ``etcd-server``, ``apiserver-etcd-client``: etcd on loopback with client-certificate auth;
- ``apiserver``: the API server's serving certificate (its Service IP, the control-plane address,
  the ``kubernetes.default.svc`` names);
- ``apiserver-kubelet-client`` (O=system:masters): the API server to the kubelets (logs, exec, ...);
- ``admin`` (O=system:masters), ``controller-manager``, ``scheduler``, ``kube-proxy`` and one
  ``node-NAME`` (CN=system:node:NAME, O=system:nodes) a kubelet: client certificates, each in a
  kubeconfig of its own;
- ``sa.key``/``sa.pub``: the service-account token signing key pair;
- ``front-proxy-ca`` and ``front-proxy-client``: the aggregation layer's own CA and the API server's
  client certificate to extension API servers (they trust the user it names in request headers
  only from a client that CA signed), as kubeadm makes them.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

from tests.e2e.cluster.layout import (
    ALL_NODES,
    APISERVER_PORT,
    CONTROL_IP,
    KUBERNETES_SERVICE_IP,
    PKI,
)

DAYS = "365"
SERVER = "serverAuth"
CLIENT = "clientAuth"
FRONT_PROXY_CA = "front-proxy-ca"
# The front proxy's client certificate: its file stem and CN, the one name extension API servers
# take X-Remote-* headers from (--requestheader-allowed-names).
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclasses.dataclass(frozen=True)
class Identity:
    """A certificate to make: its file stem, subject and use."""

    stem: str
    cn: str
    orgs: tuple[str, ...] = ()
    usage: tuple[str, ...] = (CLIENT,)
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()


def _openssl(*args: str, stdin: bytes | None = None) -> None:
    proc = subprocess.run(["openssl", *args], input=stdin, capture_output=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")


def _subject(cn: str, orgs: tuple[str, ...]) -> str:
    return "".join(f"/O={o}" for o in orgs) + f"/CN={cn}"


def make_ca(d: Path, stem: str = "ca", cn: str = "cri-shim-cluster-ca") -> None:
    key = d / f"{stem}.key"
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
    _openssl(
        "req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={cn}",
        "-days", DAYS, "-out", str(d / f"{stem}.crt"), "-config", "/dev/null",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign",
        "-addext", "subjectKeyIdentifier=hash",
    )  # fmt: skip
    key.chmod(0o600)


def make_cert(d: Path, who: Identity, ca: str = "ca") -> None:
    """``who.stem``.key and .crt, signed by the CA ``ca``.crt/.key in `d`."""
    key, csr, crt, ext = (d / f"{who.stem}.{s}" for s in ("key", "csr", "crt", "ext"))
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={','.join(who.usage)}",
        "authorityKeyIdentifier=keyid",
    ]
    alt = [f"DNS:{n}" for n in who.dns] + [f"IP:{ip}" for ip in who.ips]
    if alt:
        lines.append(f"subjectAltName={','.join(alt)}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
    _openssl(
        "req", "-new", "-key", str(key), "-subj", _subject(who.cn, who.orgs), "-out", str(csr),
        "-config", "/dev/null",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(d / f"{ca}.crt"), "-CAkey", str(d / f"{ca}.key"),
        "-CAcreateserial", "-days", DAYS, "-extfile", str(ext), "-out", str(crt),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()
    key.chmod(0o600)


def identities() -> list[Identity]:
    api_names = (
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        "localhost",
    )
    out = [
        Identity("etcd-server", "etcd", usage=(SERVER, CLIENT), dns=("localhost",), ips=("127.0.0.1",)),
        Identity("apiserver-etcd-client", "kube-apiserver-etcd-client"),
        Identity(
            "apiserver",
            "kube-apiserver",
            usage=(SERVER,),
            dns=api_names,
            ips=(KUBERNETES_SERVICE_IP, CONTROL_IP, "127.0.0.1"),
        ),
        Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)),
        Identity("admin", "kubernetes-admin", ("system:masters",)),
        Identity("controller-manager", "system:kube-controller-manager"),
        Identity("scheduler", "system:kube-scheduler"),
        Identity("kube-proxy", "system:kube-proxy"),
    ]
    out += [Identity(f"node-{n.name}", f"system:node:{n.name}", ("system:nodes",)) for n in ALL_NODES]
    return out


def kubeconfig(d: Path, stem: str, user: str) -> Path:
    """A kubeconfig (JSON is YAML) for the client certificate ``stem``, to the API server over TLS."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "cri-shim-cluster",
                "cluster": {
                    "server": f"https://{CONTROL_IP}:{APISERVER_PORT}",
                    "certificate-authority": str(d / "ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate": str(d / f"{stem}.crt"), "client-key": str(d / f"{stem}.key")},
            }
        ],
        "contexts": [{"name": "default", "context": {"cluster": "cri-shim-cluster", "user": user}}],
        "current-context": "default",
    }
    path = d / f"{stem}.kubeconfig"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    path.chmod(0o600)
    return path


def make_all(d: Path = PKI) -> None:
    """Every key, certificate and kubeconfig of the cluster, in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    make_ca(d)
    for who in identities():
        make_cert(d, who)
    make_ca(d, FRONT_PROXY_CA, "front-proxy-ca")
    make_cert(d, Identity(FRONT_PROXY_CLIENT, FRONT_PROXY_CLIENT), ca=FRONT_PROXY_CA)
    for stem, user in (
        ("admin", "kubernetes-admin"),
        ("controller-manager", "system:kube-controller-manager"),
        ("scheduler", "system:kube-scheduler"),
        ("kube-proxy", "system:kube-proxy"),
    ):
        kubeconfig(d, stem, user)
    for n in ALL_NODES:
        kubeconfig(d, f"node-{n.name}", f"system:node:{n.name}")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(d / "sa.key"))
    _openssl("pkey", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))
    (d / "sa.key").chmod(0o600)


def make_node_identities(names: list[str], d: Path = PKI) -> None:
    """A client certificate and kubeconfig per extra node (the hollow nodes' kubelets), signed by the
    CA that `make_all` made in `d`."""
    for name in names:
        make_cert(d, Identity(f"node-{name}", f"system:node:{name}", ("system:nodes",)))
        kubeconfig(d, f"node-{name}", f"system:node:{name}")


def admin_kubeconfig(d: Path = PKI) -> Path:
    return d / "admin.kubeconfig"
