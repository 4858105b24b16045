"""Hand-written doubles of what cannot run here, each rule citing its upstream file."""
