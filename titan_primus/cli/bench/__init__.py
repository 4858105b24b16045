"""``titan-primus bench``: FP8 against bf16 timings, ``--memory``'s audit, and the models of traffic and memory they print. Entry: ``command.py``."""
