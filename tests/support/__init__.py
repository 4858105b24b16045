"""What the tests share: helpers, the closeness checks, the torchrun scripts and trainer overrides
they launch, and the doubles of what cannot run here."""
