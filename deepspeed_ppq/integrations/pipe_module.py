"""A ``PipelineModule`` whose stage boundaries can be given explicitly.

DeepSpeed 0.19.8 partitions layers by ``uniform``, ``parameters`` or ``type:<regex>`` only; the
planner (and users) want exact cuts such as ``[0, 3, 10]``. ``PipelineModule.__init__`` calls
``self._partition_layers(method)`` before it builds the local layers, so overriding that one method
is enough: set ``self.parts`` and the stage's bounds, exactly as the stock methods do.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepspeed.pipe import PipelineModule

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config

__all__ = ["PPQPipelineModule", "check_boundaries"]


def check_boundaries(boundaries: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate explicit stage boundaries ``[0, b1, ..., num_layers]``.

    Returns:
        The boundaries as a list of ints.

    Raises:
        PPQConfigError: naming ``partition.boundaries``, the value and what is allowed.
    """
    b = [int(x) for x in boundaries]
    problems = []
    if len(b) != num_stages + 1:
        problems.append(f"needs num_stages + 1 = {num_stages + 1} entries, got {len(b)}")
    if not b or b[0] != 0:
        problems.append("must start at 0")
    if b and b[-1] != num_layers:
        problems.append(f"must end at the number of layers ({num_layers})")
    if any(x >= y for x, y in zip(b, b[1:])):
        problems.append("must be strictly increasing (every stage needs at least one layer)")
    if problems:
        raise PPQConfigError(
            f"ppq.partition.boundaries={b}: " + "; ".join(problems)
            + f", e.g. {_example(num_layers, num_stages)}"
        )
    return b


def _example(num_layers: int, num_stages: int) -> list[int]:
    return [round(i * num_layers / num_stages) for i in range(num_stages + 1)]


class PPQPipelineModule(PipelineModule):
    """``PipelineModule`` with ``partition_method="explicit"`` and ``boundaries=[0, b1, ..., L]``.

    Args:
        layers: the layer list (modules or ``LayerSpec``), as for ``PipelineModule``.
        num_stages: number of pipeline stages.
        boundaries: explicit cuts; stage ``s`` owns layers ``[boundaries[s], boundaries[s+1])``.
            When given, ``partition_method`` defaults to ``"explicit"``.
        **kwargs: everything else ``PipelineModule`` takes (``loss_fn``, ``topology``, ...).
    """

    def __init__(self, layers, num_stages: int | None = None, *, boundaries: Sequence[int] | None = None,
                 partition_method: str | None = None, **kwargs):
        if partition_method is None:
            partition_method = "explicit" if boundaries is not None else "parameters"
        if partition_method.lower() == "explicit" and boundaries is None:
            raise PPQConfigError("partition_method='explicit' needs boundaries=[0, b1, ..., num_layers]")
        if boundaries is not None and partition_method.lower() != "explicit":
            raise PPQConfigError(
                f"boundaries={list(boundaries)} are only used with partition_method='explicit' "
                f"(got {partition_method!r})"
            )
        self._ppq_boundaries = None if boundaries is None else list(boundaries)
        super().__init__(layers, num_stages=num_stages, partition_method=partition_method, **kwargs)

    @classmethod
    def from_config(cls, layers, num_stages: int, config: PPQConfig | dict | str | None, **kwargs):
        """Build with the partition of a ``"ppq"`` config (or a whole DeepSpeed config containing one)."""
        part = load_ppq_config(config).partition
        return cls(layers, num_stages, boundaries=part.boundaries, partition_method=part.method, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if method.lower() != "explicit":
            return super()._partition_layers(method)
        num_stages = self.num_stages
        self.parts = check_boundaries(self._ppq_boundaries, len(self._layer_specs), num_stages)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            for s in range(num_stages):
                print(f"stage={s} layers={self.parts[s + 1] - self.parts[s]} "
                      f"[{self.parts[s]}, {self.parts[s + 1]})")
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
