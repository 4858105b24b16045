"""A test-only ``[experimental] custom_import`` for TorchTitan 0.2's trainer: what
titan_primus.torchtitan02 does (registers the converter), and a record of what
titan_primus.token_dispatch's all-to-alls send (fp8_all_to_all: the packed tokens forward, their
gradient backward); TorchTitan's own all-to-alls are not recorded. One JSON line per call,
``[dtype, shape]``, to ``$TITAN_PRIMUS_DISPATCH_PROBE.<rank>``."""

import json
import os

import torch.distributed._functional_collectives as funcol

import titan_primus.token_dispatch
import titan_primus.torchtitan02  # noqa: F401  (registers the converter)

_record = f"{os.environ['TITAN_PRIMUS_DISPATCH_PROBE']}.{os.environ.get('RANK', '0')}"


class _RecordingFunctionalCollectives:
    """torch's functional collectives, recording what all_to_all_single sends."""

    def __getattr__(self, name):
        return getattr(funcol, name)

    @staticmethod
    def all_to_all_single(tensor, *args, **kwargs):
        with open(_record, "a") as f:
            f.write(json.dumps([str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]) + "\n")
        return funcol.all_to_all_single(tensor, *args, **kwargs)


titan_primus.token_dispatch.funcol = _RecordingFunctionalCollectives()
