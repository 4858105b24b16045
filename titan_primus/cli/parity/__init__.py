"""``titan-primus parity``: the op-level parity matrix, and ``--replay`` of a sentinel capture. Entry: ``command.py``."""
