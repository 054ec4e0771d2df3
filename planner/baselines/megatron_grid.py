"""The grid of Megatron-LM configurations a practitioner would try on a
cluster (:func:`megatron_configs`), each a :class:`planner.megatron_layout.MegatronConfig`
that :func:`planner.baselines.megatron.megatron_plan` plans."""

from __future__ import annotations

from typing import Sequence

from costmodel.cluster import Cluster
from planner.megatron_layout import MegatronConfig
from planner.search.stage_dp import stage_mesh_options

__all__ = ["megatron_configs"]


def megatron_configs(cluster: Cluster, global_batch: int | None = None,
                     num_layers: int | None = None, *,
                     micro_batch_sizes: Sequence[int] = (1, 2, 4),
                     virtual_stages: Sequence[int | None] = (None, 2),
                     sequence_parallel: Sequence[bool] = (False, True),
                     use_distributed_optimizer: bool = True,
                     num_experts: int | None = None,
                     expert_parallel: Sequence[int] | None = None,
                     context_parallel: Sequence[int] = (1,),
                     seq_len: int | None = None) -> list[MegatronConfig]:
    """The configurations a Megatron practitioner would try on ``cluster``.

    * tensor parallel: powers of two up to a node (and dividing the cluster);
    * pipeline parallel (only when ``num_layers`` is given): every pp that
      divides the layers and the devices left after tp, whose stages are part
      of one node or whole nodes (the sub-meshes the Plan can run);
    * data parallel: the rest;
    * micro-batch size (only when ``global_batch`` is given): each of
      ``micro_batch_sizes`` that divides the batch and leaves at least pp
      micro-batches (fewer leave ranks idle), and without a pipeline also the
      whole local batch (no gradient accumulation);
    * virtual stages: each of ``virtual_stages`` (None = plain 1F1B, v =
      interleaved) where pp >= 2, the layers split into pp x v chunks and the
      micro-batches are a multiple of pp;
    * sequence parallelism: each of ``sequence_parallel`` where tp > 1 (with
      tp = 1 the configuration is listed once, without it, as Megatron turns
      it off there);
    * expert parallelism (only for a model with experts: ``num_experts``, see
      :func:`planner.megatron_layout.num_experts`): ep = 1 and every ep > 1
      that divides the dp x tp ranks of a stage and the expert count and is a
      multiple or a divisor of tp (:class:`MegatronConfig`), or those of
      ``expert_parallel`` (ep = 1 included only when listed there);
    * context parallelism: each cp of ``context_parallel`` (default 1 only)
      that divides the devices left after tp and pp, and, with ``seq_len``,
      cuts the sequence into 2 cp chunks (and s / cp into tp pieces under
      sequence parallelism); dp is what is left after tp, cp and pp.

    Pruning, to keep the grid small (each pipeline configuration costs one
    ILP per stage): the powers of two above, the micro-batch sizes given
    (default 1, 2, 4) and v <= 2. Memory is pruned later, by the plans
    themselves: a configuration that does not fit raises
    :class:`planner.baselines.megatron_memory.MegatronDoesNotFit` (and
    :func:`planner.baselines.compare.compare` then skips the larger
    micro-batch sizes of the same tp/pp/dp/vpp/sp).

    Order: pp, then tp, then cp, then micro-batch size, then v, then ep,
    ascending, then sequence parallelism in the order of ``sequence_parallel``
    (off first by default).
    """

    n, dpn = cluster.num_devices, cluster.devices_per_node
    out: list[MegatronConfig] = []

    def add(tp: int, dp: int, pp: int = 1, v: int | None = None, mbs: int | None = None,
            cp: int = 1) -> None:
        for ep in _expert_parallel_sizes(tp, dp * cp, num_experts, expert_parallel):
            for sp in dict.fromkeys(bool(s) and tp > 1 for s in sequence_parallel):
                if sp and seq_len is not None and (seq_len // cp) % tp:
                    continue
                out.append(MegatronConfig(tp, dp, use_distributed_optimizer, pp, v, mbs, sp,
                                          expert_model_parallel_size=ep, context_parallel_size=cp))

    for pp in _pipeline_sizes(cluster, num_layers):
        for tp, cp in ((t, c) for t in _tensor_parallel_sizes(n, dpn)
                       for c in sorted(set(context_parallel))):
            if (n // pp) % (tp * cp) or (cp > 1 and seq_len is not None
                                         and seq_len % (2 * cp)):
                continue
            dp = n // (pp * tp * cp)
            mbss = _micro_batch_sizes(global_batch, micro_batch_sizes, dp, pp)
            for mbs in mbss:
                for v in ([None] if pp == 1 else virtual_stages):
                    if v is not None and (num_layers % (pp * v) or (
                            global_batch is not None and (global_batch // (mbs * dp)) % pp)):
                        continue
                    add(tp, dp, pp, v, mbs, cp)
    return out


def _expert_parallel_sizes(tp: int, dp: int, experts: int | None,
                           wanted: Sequence[int] | None) -> list[int]:
    """The ep values of the grid for one (tp, dp): 1 and the ep > 1 that divide
    dp x tp and ``experts`` and nest with tp (only 1 without experts), kept
    to those in ``wanted`` when given; ascending."""
    if not experts:
        return [1]
    eps = [e for e in range(1, dp * tp + 1)
           if (dp * tp) % e == 0 and experts % e == 0 and (e % tp == 0 or tp % e == 0)]
    return eps if wanted is None else [e for e in eps if e in set(wanted)]


def _pipeline_sizes(cluster: Cluster, num_layers: int | None) -> list[int]:
    """The pp of the grid: 1 without ``num_layers``, else each pp that divides
    the layers and the devices, whose stages are part of one node or whole
    nodes."""
    n = cluster.num_devices
    pps = [1] if num_layers is None else [p for p in range(1, n + 1)
                                          if n % p == 0 and num_layers % p == 0]
    return [pp for pp in pps if pp == 1 or stage_mesh_options(cluster, pp)]


def _tensor_parallel_sizes(n: int, devices_per_node: int) -> list[int]:
    """The tp of the grid: powers of two up to a node that divide the ``n`` devices."""
    tps = []
    tp = 1
    while tp <= min(n, devices_per_node):
        if n % tp == 0:
            tps.append(tp)
        tp *= 2
    return tps


def _micro_batch_sizes(global_batch: int | None, micro_batch_sizes: Sequence[int], dp: int,
                       pp: int) -> list[int | None]:
    """The micro-batch sizes of the grid for one (dp, pp): each of
    ``micro_batch_sizes`` that divides the batch and leaves at least pp
    micro-batches, and without a pipeline also the whole local batch; [None]
    without a batch."""
    mbss: list[int | None] = [None] if global_batch is None else [
        b for b in micro_batch_sizes
        if global_batch % (b * dp) == 0 and global_batch // (b * dp) >= pp]
    if pp == 1:  # and the whole local batch at once
        if global_batch is not None and global_batch % dp == 0 \
                and global_batch // dp not in mbss:
            mbss.append(global_batch // dp)
    return mbss
