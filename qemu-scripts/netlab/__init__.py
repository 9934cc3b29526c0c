"""netlab: real TCG VMs on a private bridge, for pvcm's network tests.

    import netlab                      # with PYTHONPATH=qemu-scripts
    with netlab.Lab("/tmp/work") as lab:
        k = lab.kernel_guest("k", "10.99.0.2")
        rc, out = k.run("rdma link")

See lab.py (Lab, Guest, Job, Backend) and docs/qemu.md, "The network lab".
"""

from .addr import family, sysfs_gid, vm_gid
from .lab import (
    BRIDGE,
    DIVERT_DEV,
    HOST_IP,
    HOST_IP6,
    Backend,
    Guest,
    Job,
    Lab,
    LabError,
    backend_path,
    mac_of,
    node_guid_of,
    qemu_path,
    rdma_image,
)

__all__ = [
    "family",
    "sysfs_gid",
    "vm_gid",
    "BRIDGE",
    "DIVERT_DEV",
    "HOST_IP",
    "HOST_IP6",
    "Backend",
    "Guest",
    "Job",
    "Lab",
    "LabError",
    "backend_path",
    "mac_of",
    "node_guid_of",
    "qemu_path",
    "rdma_image",
]
