"""Memory, in one place: what a converted layer keeps from forward to backward, measured
(``saved``), the model of a whole model's memory per rank built from it (``model``, on the shapes
of ``titan_primus.diagnostics.model_shapes``), and the audit ``bench --memory`` reports (``audit``)."""
