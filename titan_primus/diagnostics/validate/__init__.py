"""``titan-primus validate``'s computation: the plans (``run``), each config's four runs of
TorchTitan's real trainer on the line installed (``lines``, started through ``launch``), the
baseline check (``baseline``) and the verdicts (``judge``, ``verdicts``)."""
