"""``titan-primus validate``: the upgrade gate (TorchTitan's real trainer, FP8 against bf16 and two noise floors). Entry: ``command.py``."""
