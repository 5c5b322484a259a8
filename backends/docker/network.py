"""Pods on the node's CNI network (``pod_network = "cni"``), as cri-dockerd wires them.

The pause container of a pod that does not share the host's network is created with no engine
network (``none``) and the engine's networking off (its hosts and resolv.conf: pod_files.py).
Once it runs, the network namespace of its process is pinned to a file
(``<state_dir>/netns/<sandbox id>``, :mod:`backends.linux.netns`) and ADDed to the network of the
node's CNI config (:mod:`backends.cni.pods`); the pod's addresses are the result's. The app
containers join that namespace as with the engine's network. The pin's path is what the CNI
cache keeps, so a DEL made after the pause process is gone (or after a restart) still reaches
that namespace and no other.

- a failed ADD (or a failure after it) DELs and unpins, and the caller removes the pause
  container: nothing is left;
- StopPodSandbox DELs, from the cache, before the pause container stops, then unpins. A DEL
  that fails is raised after the pause container stopped (the kubelet stops again);
- RemovePodSandbox DELs what a stop did not, logs a plugin's failure, and unpins whatever
  happened: a remove never fails because a plugin does (a later start's recovery DELs from the
  cache what is still there);
- recovery DELs every cached attachment of a pod with no committed record (the shim died between
  the ADD and the record) and unpins what such pods left.

``backend_data["netns"]`` marks a pod on CNI: stop and remove act on it whatever the handler's
``pod_network`` says now, so that pods made before a change are released all the same.
"""

from __future__ import annotations

# The mechanism is runv's too (its VM process's namespace): it lives with the CNI client.
from backends.cni.pinned import NETNS, CniPods

__all__ = ["NETNS", "CniPods"]
