"""What both CPU launchers (TorchTitan 0.3's titan_primus/integrations/torchtitan/v0_3/launch.py and 0.2.x's
titan_primus/integrations/torchtitan/v0_2/launch.py) set up before TorchTitan is imported. Importing it:

(0) keeps the Hugging Face libraries offline: the debug configs' dataset and tokenizer are local
    files, and the machine may have no network;
(1) gives a plain ``python`` run a single-process world (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT): the trainer reads LOCAL_RANK and init_process_group needs a rendezvous,
    which torchrun would provide;
(2) has glibc's malloc keep the memory of freed tensors for the next step (below).

``CPU_DEVICE_MODULE`` stands in for torch.cuda: torch.cpu lacks the memory and introspection
calls the trainer makes (metrics' DeviceMemoryMonitor, set_pg_timeouts' barrier uses
current_device() as an integer device id). Its "memory" numbers are the process's peak RSS.
"""

import ctypes
import os
import resource
import sys
import types

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if "LOCAL_RANK" not in os.environ:
    # Port 0: the one rank's store binds a free port itself (a port found free here and released
    # could be taken by a concurrent run before the store binds it).
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    ).items():
        os.environ.setdefault(key, value)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_freed_memory() -> None:
    """glibc maps each block over its mmap threshold (128 KiB at first, rising to the largest block
    freed) from the kernel and unmaps it when freed, so every step faults the pages of its
    activations in again, zeroed by the kernel: of a 2-rank qwen3_moe_debug test's 113 s of CPU,
    38 s were the kernel's. Blocks up to 32 MiB (glibc's largest threshold) now come from the heap,
    which is never trimmed, so what is freed serves the next allocation: that test's kernel time
    38 -> 22 s, wall 71 -> 60 s, peak RSS 4.8 -> 5.1 GB (alone on this project's 2-core machine,
    2026-12-05; 116 -> 103 s in CI beside other tests). The numbers computed do not change;
    without glibc (musl, macOS) nothing is done."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, -1)  # never trim (mallopt(3))


_keep_freed_memory()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


CPU_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: 0,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    reset_peak_memory_stats=lambda device=None: None,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ),
    memory_stats=lambda device=None: {
        "active_bytes.all.peak": _peak_rss(),
        "reserved_bytes.all.peak": _peak_rss(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    },
)


def with_sum_reduction(disable_gradient_division):
    """TorchTitan's ``disable_fsdp_gradient_division``, also making every FSDP2 module reduce
    gradients with a plain SUM: FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM(1 / factor), which
    gloo lacks, and TorchTitan sets the factor to 1 (it scales gradients itself), so SUM is the
    same math."""
    from torch.distributed.fsdp import FSDPModule

    def disable_gradient_division_gloo(model) -> None:
        disable_gradient_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return disable_gradient_division_gloo


def without_sleep(time_module):
    """``time_module`` with ``sleep`` doing nothing: for the trainer module's own ``time``, whose
    only sleep is rank 0's 2 s wait "for other ranks to complete" after the last step. The
    launcher's ranks each end by themselves (:func:`exit_without_teardown`) and torchrun waits for
    every one, so the wait only added 2 s to each run (a suite of about a hundred runs)."""

    class TimeWithoutSleep(types.ModuleType):
        def __getattr__(self, name):
            return getattr(time_module, name)

        @staticmethod
        def sleep(seconds) -> None:
            del seconds

    return TimeWithoutSleep(time_module.__name__)


def exit_without_teardown(code) -> None:
    """End the process once the trainer has returned: with torch 2.14 and gloo, a multi-rank CPU
    process sometimes aborts during interpreter teardown ("terminate called without an active
    exception") after all of its work is done, which would turn a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0)
