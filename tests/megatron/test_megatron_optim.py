"""Low-bit compute weights follow the optimizer: bitsandbytes 8-bit and megatron-core's own bf16 optimizer.

Neither moves the parameter's autograd version counter (bnb writes through its kernels,
megatron-core copies main params into model params through ``.data``), so the lazy version check in
``QuantParallelLinear`` alone would leave the compute copy at the initial weights. Run by hand with
``tests/mcore/optim_rank.py unfixed`` (2 ranks) (the hooks left out), the ``copy_matches_*`` checks below are
False; with them, True.
"""

from __future__ import annotations

import pytest
from dist_utils import ROOT, run_ranks

MCORE = ROOT / "tests" / "mcore"  # the rank scripts


@pytest.fixture(scope="module")
def optim_results():
    return run_ranks(MCORE / "optim_rank.py", 2, ["fixed"], timeout=300)


@pytest.fixture(scope="module")
def optim_result(optim_results):
    assert optim_results[0] == optim_results[1]  # data parallel: both ranks saw the same
    return optim_results[0]


@pytest.mark.distributed
def test_bnb_adam8bit_step_requantizes_from_master(optim_result):
    r = optim_result["bnb"]
    assert r["layers"] == 8 and r["master_moved"]
    assert r["copy_matches_master"] is True
    assert r["copy_matches_after_forward"] is True
    assert r["forward_requantized_again"] is False  # the step hook did it, the forward does not repeat it


@pytest.mark.distributed
def test_megatron_bf16_optimizer_step_requantizes_from_fp32_main_params(optim_result):
    r = optim_result["megatron"]
    assert r["inner"] == "Float16OptimizerWithFloat16Params" and r["weight_dtype"] == "torch.bfloat16"
    assert r["success"] and r["master_moved"] and r["all_have_main"]
    assert r["copy_matches_main"] is True
    assert r["forward_requantized_again"] is False


@pytest.mark.distributed
def test_megatron_fp32_optimizer_step_requantizes_from_params(optim_result):
    r = optim_result["fp32"]
    assert r["optimizer"] == "FP32Optimizer" and r["success"] and r["master_moved"]
    assert r["copy_matches_master"] is True


@pytest.mark.distributed
def test_step_skipped_for_inf_grads_does_not_requantize(optim_result):
    r = optim_result["skipped"]
    assert r["success"] is False and r["master_moved"] is False
    assert r["requantized"] is False


def test_step_wrapping_is_idempotent_and_undone():
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, MixedPrecisionOptimizer

    from megatron_patches.optim import install_step_hooks, uninstall_step_hooks

    uninstall_step_hooks()  # start from megatron-core's own methods whatever ran before
    originals = {c: c.__dict__["step"] for c in (ChainedOptimizer, FP32Optimizer, MixedPrecisionOptimizer)}
    try:
        names = install_step_hooks()
        assert {"ChainedOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer"} <= set(names)
        wrapped = {c: c.__dict__["step"] for c in originals}
        assert install_step_hooks() == names  # a second install wraps nothing twice
        for c, step in wrapped.items():
            assert step is not originals[c]
            assert c.__dict__["step"] is step
    finally:
        uninstall_step_hooks()
    for c, step in originals.items():
        assert c.__dict__["step"] is step


@pytest.mark.distributed
def test_distributed_optimizer_copies_follow_the_param_all_gather(optim_result):
    """DP=2: re-quantized at the step with a synchronous all-gather; marked stale and re-quantized in the
    next forward when the all-gather overlaps it."""
    sync, overlap = optim_result["sync_gather"], optim_result["overlap_gather"]
    assert sync["inner"] == "DistributedOptimizer" and sync["success"] and sync["layers"] == 8
    assert sync["requantized_at_step"] and not sync["marked_stale"]
    assert overlap["marked_stale"] and not overlap["requantized_at_step"]
    assert sync["copy_matches_after_forward"] is True
    assert overlap["copy_matches_after_forward"] is True
