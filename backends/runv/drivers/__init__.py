"""runv's hypervisor drivers, behind ``backends.runv.hypervisor.Hypervisor``.

- :mod:`.base`: what both share (``ProcessVMs``: the VM process in its cgroup, the node's
  capacity, shares attached by the share helper :mod:`.inject`);
- :mod:`.stub`: a VM is namespaces and a cgroup on the host kernel (the default);
- :mod:`.qemu`: a VM is a QEMU virtual machine booting the guest image.
"""
