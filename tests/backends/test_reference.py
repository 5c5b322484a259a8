"""The one image-reference parser: a table of references and what each means."""

from __future__ import annotations

import pytest

from backends.reference import BadReference, parse

SHA256 = "sha256:" + "a" * 64
SHA512 = "sha512:" + "b" * 128

# reference -> (domain, path, tag, digest, canonical name)
GOOD = [
    ("busybox", ("docker.io", "library/busybox", "latest", "", "docker.io/library/busybox:latest")),
    ("busybox:1.36", ("docker.io", "library/busybox", "1.36", "", "docker.io/library/busybox:1.36")),
    ("user/app", ("docker.io", "user/app", "latest", "", "docker.io/user/app:latest")),
    ("docker.io/busybox", ("docker.io", "library/busybox", "latest", "", "docker.io/library/busybox:latest")),
    ("127.0.0.1:5000/busybox:1.36", ("127.0.0.1:5000", "busybox", "1.36", "", "127.0.0.1:5000/busybox:1.36")),
    ("localhost/a/b", ("localhost", "a/b", "latest", "", "localhost/a/b:latest")),
    ("localhost:5000/x", ("localhost:5000", "x", "latest", "", "localhost:5000/x:latest")),
    ("[::1]:5000/x:t", ("[::1]:5000", "x", "t", "", "[::1]:5000/x:t")),
    (
        "registry.k8s.io/e2e-test-images/busybox:1.29-2",
        (
            "registry.k8s.io",
            "e2e-test-images/busybox",
            "1.29-2",
            "",
            "registry.k8s.io/e2e-test-images/busybox:1.29-2",
        ),
    ),
    ("quay.io/x/y@" + SHA256, ("quay.io", "x/y", "", SHA256, "quay.io/x/y@" + SHA256)),
    ("quay.io/x/y:v1@" + SHA256, ("quay.io", "x/y", "v1", SHA256, "quay.io/x/y@" + SHA256)),
    ("r.io/x@" + SHA512, ("r.io", "x", "", SHA512, "r.io/x@" + SHA512)),
    ("foo__bar/baz", ("docker.io", "foo__bar/baz", "latest", "", "docker.io/foo__bar/baz:latest")),
    ("a.b-c/d_e--f", ("a.b-c", "d_e--f", "latest", "", "a.b-c/d_e--f:latest")),
    ("My.Registry.io/app:Tag_1.x", ("My.Registry.io", "app", "Tag_1.x", "", "My.Registry.io/app:Tag_1.x")),
]

BAD = [
    ("", "empty"),
    (" busybox", "leading space"),
    ("UPPER/case", "upper-case path"),
    ("busybox:bad tag", "space in tag"),
    ("a:b:c", "two tags"),
    ("a@sha256:12", "short digest"),
    ("a@sha256:" + "A" * 64, "upper-case digest"),
    ("a@sha512:" + "b" * 64, "sha512 of sha256 length"),
    ("a@md5:" + "c" * 32, "unknown digest algorithm"),
    ("foo___bar", "three underscores"),
    ("-foo/bar", "leading separator"),
    ("foo/bar/", "trailing slash"),
    ("bad_host.io:99/x", "underscore in host"),
    ("r.io/" + "a" * 300, "name over 255"),
    ("busybox:" + "t" * 129, "tag over 128"),
]


@pytest.mark.parametrize(("ref", "want"), GOOD, ids=[r[:40] for r, _ in GOOD])
def test_good(ref: str, want: tuple[str, str, str, str, str]) -> None:
    r = parse(ref)
    assert (r.domain, r.path, r.tag, r.digest, r.name) == want


@pytest.mark.parametrize("ref", [r for r, _ in BAD], ids=[i for _, i in BAD])
def test_bad(ref: str) -> None:
    with pytest.raises(BadReference):
        parse(ref)


def test_docker_hub_api_host() -> None:
    assert parse("busybox").api_host == "registry-1.docker.io"
    assert parse("127.0.0.1:5000/x").api_host == "127.0.0.1:5000"
