# zeroplan.core — pure planning: no torch, no I/O.
# Importable with torch absent; every value is a frozen dataclass validated on construction.
"""zeroplan's pure planner.

From parameter descriptions and a topology it computes, as immutable values,
the partition plan, the gradient bucket layout, loss-scaler transitions,
memory per rank, bytes moved per step and reshard plans. No GPU, no process
group and no torch are needed::

    >>> from zeroplan.core import Topology, memory_report, plan, specs_from_shapes
    >>> zp = plan(specs_from_shapes([(4096, 4096)] * 4, dtype="bf16"),
    ...           Topology(world_size=8), stage=2, optimizer="AdamW")
    >>> report = memory_report(zp)
    >>> report.ranks[0].optimizer_state_bytes == report.ranks[7].optimizer_state_bytes
    True
"""

from zeroplan.core.arena import StagingArena, StagingLayout, grad_shard_dtype, staging_arena, staging_layout
from zeroplan.core.buckets import Bucket, BucketLayout, GradCopy, Piece, plan_buckets
from zeroplan.core.comm import (
    STEP_AGREEMENT_ELEMENTS,
    STEP_AGREEMENT_ITEMSIZE,
    Collective,
    CollectivePolicy,
    send_elements,
)
from zeroplan.core.domains import (
    Domain,
    DomainPlans,
    DomainsReport,
    ParamLocation,
    domains_report,
    plan_domains,
)
from zeroplan.core.dtypes import canonical_dtype, itemsize, master_dtype
from zeroplan.core.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    IncompatiblePlanError,
    PlanInvariantError,
    StepOrderError,
    ZeroplanError,
)
from zeroplan.core.experts import ExpertSplit, expert_domains
from zeroplan.core.hierarchy import GatherCall, HopSend, TwoHopGather, two_hop_gather, two_hop_send
from zeroplan.core.host_step import (
    StepUnit,
    UpCopy,
    kept_tensors,
    kept_unit,
    publishes_via_host_cast,
    step_units,
)
from zeroplan.core.host_traffic import HostLink, host_link, host_links
from zeroplan.core.layout import AUTO_MAX_PIECES, LAYOUTS, build_partition
from zeroplan.core.memory import (
    MemoryReport,
    RankReport,
    accumulation_bytes,
    memory_report,
    save_staging_bytes,
)
from zeroplan.core.mesh import MeshRoles, mesh_roles, pipeline_stages, pipeline_traffic
from zeroplan.core.offload import Offload, offload_residences
from zeroplan.core.optim.implementations import Implementation, resolve_implementation
from zeroplan.core.optim.optimizers import OptimizerSpec, describe_optimizer, known_optimizers
from zeroplan.core.optim.step_tables import step_temporaries
from zeroplan.core.optim.temporaries import StepTemporaries
from zeroplan.core.options import StepOptions
from zeroplan.core.partition import Fragment, FragmentOverlap, PartitionPlan, Space, plan_from_assignment
from zeroplan.core.peak import BackwardPeak, PeakPhase, StepPeak, backward_peak, step_peak, step_transient
from zeroplan.core.placement import MeshPlacement, Placement, Replicate, Shard
from zeroplan.core.planner import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    GatherKind,
    InnerTensor,
    ReductionKind,
    Stage,
    WindowOverlap,
    ZeroPlan,
    auto_strategy,
    plan,
    windows_in,
)
from zeroplan.core.reshard import Copy, ReshardPlan, compare_specs, plan_reshard
from zeroplan.core.residence import KEPT_ROLES, BufferRole, Residence, Residences
from zeroplan.core.scaler import ScalerConfig, ScalerState, initial_state, update
from zeroplan.core.sizing.activations import (
    ActivationMemory,
    Recompute,
    TransformerDims,
    activation_memory,
    dims_from_config,
)
from zeroplan.core.sizing.fit import FitReport, RankFit, fit_report
from zeroplan.core.sizing.presets import preset_dims, preset_names, preset_specs
from zeroplan.core.sizing.recommend import Option, Recommendation, recommend, shard_sizes
from zeroplan.core.space import Block, ShardPiece
from zeroplan.core.span import Span
from zeroplan.core.specs import (
    ParamSpec,
    check_specs,
    specs_fingerprint,
    specs_from_module,
    specs_from_shapes,
)
from zeroplan.core.strategies import (
    PartitionStrategy,
    flat_even,
    get_strategy,
    greedy_whole,
    lpt_whole,
    register_strategy,
    strategy_names,
)
from zeroplan.core.tensor_parallel import (
    chunk_rows,
    norm_windows,
    tensor_parallel_specs,
    tensor_replicas,
    tensor_split,
    tensor_traffic,
)
from zeroplan.core.topology import Link, Topology
from zeroplan.core.traffic import CommCost, communication

__all__ = [
    "AUTO_MAX_PIECES",
    "LAYOUTS",
    "STEP_AGREEMENT_ELEMENTS",
    "STEP_AGREEMENT_ITEMSIZE",
    "Block",
    "ShardPiece",
    "build_partition",
    "ActivationMemory",
    "FitReport",
    "Option",
    "RankFit",
    "Recommendation",
    "Recompute",
    "TransformerDims",
    "activation_memory",
    "dims_from_config",
    "fit_report",
    "preset_dims",
    "recommend",
    "shard_sizes",
    "BackwardPeak",
    "PeakPhase",
    "StagingLayout",
    "StagingArena",
    "BufferRole",
    "Residence",
    "Residences",
    "Offload",
    "offload_residences",
    "kept_tensors",
    "kept_unit",
    "KEPT_ROLES",
    "HostLink",
    "StepUnit",
    "UpCopy",
    "host_link",
    "host_links",
    "publishes_via_host_cast",
    "step_units",
    "StepPeak",
    "backward_peak",
    "grad_shard_dtype",
    "staging_layout",
    "staging_arena",
    "accumulation_bytes",
    "save_staging_bytes",
    "step_peak",
    "step_transient",
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "BucketLayout",
    "CheckpointError",
    "Collective",
    "CollectivePolicy",
    "Copy",
    "CommCost",
    "ConfigError",
    "ConfigTypeError",
    "Domain",
    "DomainPlans",
    "DomainsReport",
    "ExpertSplit",
    "Fragment",
    "FragmentOverlap",
    "GatherCall",
    "GatherKind",
    "GradCopy",
    "HopSend",
    "Implementation",
    "IncompatiblePlanError",
    "InnerTensor",
    "Link",
    "MemoryReport",
    "MeshPlacement",
    "OptimizerSpec",
    "ParamLocation",
    "ParamSpec",
    "PartitionPlan",
    "PartitionStrategy",
    "Piece",
    "Placement",
    "PlanInvariantError",
    "StepOrderError",
    "StepTemporaries",
    "RankReport",
    "ReductionKind",
    "Replicate",
    "MeshRoles",
    "mesh_roles",
    "pipeline_stages",
    "pipeline_traffic",
    "norm_windows",
    "tensor_parallel_specs",
    "tensor_replicas",
    "tensor_split",
    "chunk_rows",
    "tensor_traffic",
    "ReshardPlan",
    "ScalerConfig",
    "ScalerState",
    "Shard",
    "Space",
    "Span",
    "Stage",
    "StepOptions",
    "Topology",
    "TwoHopGather",
    "WindowOverlap",
    "ZeroPlan",
    "ZeroplanError",
    "auto_strategy",
    "canonical_dtype",
    "check_specs",
    "communication",
    "compare_specs",
    "describe_optimizer",
    "domains_report",
    "expert_domains",
    "flat_even",
    "get_strategy",
    "greedy_whole",
    "initial_state",
    "itemsize",
    "known_optimizers",
    "lpt_whole",
    "master_dtype",
    "memory_report",
    "plan",
    "plan_buckets",
    "plan_domains",
    "plan_from_assignment",
    "plan_reshard",
    "preset_names",
    "preset_specs",
    "register_strategy",
    "resolve_implementation",
    "send_elements",
    "specs_fingerprint",
    "specs_from_module",
    "specs_from_shapes",
    "step_temporaries",
    "strategy_names",
    "two_hop_gather",
    "two_hop_send",
    "update",
    "windows_in",
]
