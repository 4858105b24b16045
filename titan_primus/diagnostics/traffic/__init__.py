"""Bytes on the wire per training step, modelled from shapes: FSDP2's weight all-gathers (``fsdp``)
and expert parallelism's token all-to-alls (``ep``), each with and without FP8."""
