import pytest

from shim.imageref import BadReference, parse


@pytest.mark.parametrize(
    ("ref", "name"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("busybox:1.36", "docker.io/library/busybox:1.36"),
        ("user/app", "docker.io/user/app:latest"),
        ("127.0.0.1:5000/busybox:1.36", "127.0.0.1:5000/busybox:1.36"),
        ("localhost/x", "localhost/x:latest"),
        ("registry.k8s.io/pause@sha256:" + "a" * 64, "registry.k8s.io/pause@sha256:" + "a" * 64),
    ],
)
def test_normalise(ref: str, name: str) -> None:
    assert parse(ref).name == name


@pytest.mark.parametrize("ref", ["", " busybox", "UPPER/case", "a@sha256:short", "a:b:c"])
def test_bad(ref: str) -> None:
    with pytest.raises(BadReference):
        parse(ref)
