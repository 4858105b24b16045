"""What every TorchTitan line shares: the import diagnosis (``imports``), the CPU world both CPU
launchers set up (``cpu_world``), the debug models' tokenizer and corpus (``debug_data``), the
validate hooks' common part (``trainer``) and the declared patches' record (``seams``).
Importing this package imports nothing else."""
