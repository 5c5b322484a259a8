"""The network config rendered from a template with the node's pod CIDRs (as containerd's
``conf_template``): the pod subnet filled in, the result written to the config directory.

This is plain substitution, not Go's text/template. The placeholders (``{{.Name}}``, spaces
inside the braces allowed):

- ``{{.PodCIDR}}``: the first pod CIDR, e.g. ``10.244.1.0/24``;
- ``{{.HostLocalRanges}}``: host-local's ``ranges`` for every pod CIDR, as JSON
  (``[[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:1::/64"}]]``);
- ``{{.DefaultRoutes}}``: a default route for each family of the pod CIDRs, as JSON
  (``[{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]``).

Any other placeholder is an error naming the template; so is a rendering that is not a valid
network config.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence

from backends.cni.config import parse_network
from backends.cni.errors import ConfigError

_PLACEHOLDER = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")
_DEFAULTS = ((4, "0.0.0.0/0"), (6, "::/0"))


def render(text: str, pod_cidrs: Sequence[str], source: str) -> str:
    """The template ``text`` (read from ``source``) with the pod CIDRs filled in, validated."""
    families = {ipaddress.ip_network(c, strict=False).version for c in pod_cidrs}
    values = {
        "PodCIDR": pod_cidrs[0] if pod_cidrs else "",
        "HostLocalRanges": json.dumps([[{"subnet": c}] for c in pod_cidrs]),
        "DefaultRoutes": json.dumps([{"dst": d} for v, d in _DEFAULTS if v in families]),
    }

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ConfigError(source, match.group(0), f"unknown placeholder (known: {', '.join(values)})")
        return values[name]

    rendered = _PLACEHOLDER.sub(fill, text)
    try:
        data = json.loads(rendered)
    except ValueError as exc:
        raise ConfigError(source, "", f"rendered with {','.join(pod_cidrs)}, not JSON: {exc}") from exc
    parse_network(data, f"{source} (rendered)")
    return rendered
