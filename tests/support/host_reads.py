"""Counting what would make a host wait for a GPU, on any device: the ops run as they would there."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor on the host (each one a device-to-host sync on a GPU:
    ``.item()``, a copy to the CPU), the ops whose output size depends on the data (``nonzero``:
    a sync too), and the device-side asserts."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0
        self.data_dependent = 0
        self.device_asserts = 0

    @property
    def syncs(self) -> int:
        return self.host_reads + self.data_dependent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A copy to the CPU from another device (a dtype cast on the CPU reads nothing back).
        to_host = (
            func is torch.ops.aten._to_copy.default
            and str(kwargs.get("device")) == "cpu"
            and args[0].device.type != "cpu"
        )
        self.host_reads += func is torch.ops.aten._local_scalar_dense.default or to_host
        self.data_dependent += func is torch.ops.aten.nonzero.default
        self.device_asserts += func is torch.ops.aten._assert_async.msg
        return func(*args, **kwargs)
