"""``seed_layer``: DeepSpeed's per-layer seeding without ``torch.manual_seed``'s stack formatting.

The pipeline part runs this file as a script in a fresh process (``run_ranks(__file__, 1)``): a
``PPQPipelineModule`` with ``seed_layers`` against DeepSpeed's own ``PipelineModule`` with the same
layers and seed, dropout on.
"""

from __future__ import annotations

import random
import sys
import traceback

import numpy as np
import pytest
import torch
from torch import nn

from deepspeed_ppq.integrations.pipe_module import seed_layer

SEEDS = [0, 1234 * 3 + 5, 2**40 + 7, 2**64 + 3]


def _states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_layer_seeds_as_deepspeed_does(seed):
    from deepspeed.runtime.utils import set_random_seed

    set_random_seed(seed)
    want = _states()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    seed_layer(seed)
    got = _states()
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1])
    assert torch.equal(got[2], want[2])


def test_seed_layer_takes_numpy_integers():
    """DeepSpeed's partition_method='parameters' hands the seed over as a NumPy integer."""
    seed_layer(77)
    want = _states()
    seed_layer(np.int64(77))
    got = _states()
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and torch.equal(got[2], want[2])
    with pytest.raises(TypeError):
        seed_layer(77.0)


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="CUDA initialised: manual_seed seeds it directly")
def test_seed_layer_formats_no_stack(monkeypatch):
    """torch.manual_seed formats the caller's stack for each device backend not initialised yet (the cost
    seed_layer avoids); seed_layer formats none."""
    def no_stack(*a, **k):
        raise AssertionError("formatted a stack")

    monkeypatch.setattr(traceback, "format_stack", no_stack)
    seed_layer(5)
    with pytest.raises(AssertionError, match="formatted a stack"):
        torch.manual_seed(5)


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


def _same_parameters(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _pipeline_rank() -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from dist_utils import write_result

    from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    specs = [LayerSpec(_Noisy) for _ in range(4)]
    stock = PipelineModule(specs, num_stages=1, partition_method="uniform", seed_layers=True, base_seed=77)
    ours = PPQPipelineModule(specs, num_stages=1, boundaries=[0, 4], seed_layers=True, base_seed=77)

    def own_seed(seed):
        torch.manual_seed(seed)

    custom = PPQPipelineModule(specs, num_stages=1, boundaries=[0, 4], seed_layers=True, seed_fn=own_seed)
    # no boundaries: DeepSpeed's default partition_method='parameters', whose layer indices are NumPy
    # integers (DeepSpeed's own PipelineModule with seed_layers raises there)
    by_params = PPQPipelineModule(specs, num_stages=1, seed_layers=True, base_seed=77)
    x = torch.randn(8, 16)
    outs = []
    for module in (stock, ours):
        module.train()
        torch.manual_seed(0)
        outs.append([module(x).tolist() for _ in range(2)])  # the seed depends on the micro-batch count
    write_result({
        "params_equal": _same_parameters(stock, ours),
        "params_equal_by_params": _same_parameters(stock, by_params),
        "outputs_equal": outs[0] == outs[1],
        "dropped": sum(v == 0.0 for row in outs[1][0] for v in row),
        "seed_fns": [ours.seed_fn.__name__, custom.seed_fn.__name__],
    })


@pytest.mark.distributed
def test_a_seeded_pipeline_module_builds_and_runs_as_deepspeeds():
    """Same parameters and the same dropout masks as DeepSpeed's PipelineModule with ``seed_layers``, also
    when partitioned by parameters (DeepSpeed's default); a ``seed_fn`` of the user's own is kept."""
    from dist_utils import run_ranks

    (res,) = run_ranks(__file__, 1, ["--pipeline-rank"], timeout=300)
    assert res["params_equal"] and res["outputs_equal"] and res["params_equal_by_params"]
    assert res["dropped"] > 0  # dropout was on: the masks were compared
    assert res["seed_fns"] == ["seed_layer", "own_seed"]


if __name__ == "__main__" and "--pipeline-rank" in sys.argv:
    _pipeline_rank()
