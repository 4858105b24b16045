"""The Primus-Turbo rules on the REAL kernels and GPU (``mi300``: an MI300-class GPU with
Primus-Turbo installed; ci/mi300x.sh). The tests are tests/support/mi300_primus_turbo.py's, which
the real-code tier collects too (tests/real_turbo/test_hardware_bodies*.py); what each asserts is
said there."""

import pytest
from support.mi300_primus_turbo import (  # noqa: F401  (collected here, on the MI300-class GPU)
    test_any_number_of_tokens,
    test_compiled_path_on_the_real_kernels,
    test_contiguous_b_t_runs_without_transposition,
    test_dense_contraction_edges,
    test_fp32_activations,
    test_fsdp_gathered_fp8_weights_give_exactly_the_normal_path,
    test_grouped_small_k_edge,
    test_tail_rows_of_the_public_op,
    turbo,
)

pytestmark = pytest.mark.mi300
