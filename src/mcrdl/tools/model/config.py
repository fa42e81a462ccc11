"""Model description: a GPT/Megatron-style transformer (optionally MoE), its
parallel layout, the placement of ranks on nodes and the compute assumptions.

Loaded from JSON (or YAML when PyYAML is installed) and validated; every error
is a :class:`ModelConfigError` whose message names the field at fault, e.g.
``gpt.json: parallel.tensor: heads (12) must be divisible by tensor (8)``.

Document layout (docs/model.md is the reference)::

    {
      "name": "gpt-small",
      "model":    {"layers": 4, "hidden": 256, "heads": 8, "seq_length": 128, "vocab": 1024,
                   "micro_batch": 2, "global_batch": 16, "bytes_per_element": 4,
                   "moe": {"experts": 8, "top_k": 2, "capacity_factor": 1.25, "every": 2}},
      "parallel": {"pipeline": 1, "tensor": 2, "data": 2, "expert": 1, "zero": 0},
      "cluster":  {"world_size": 4, "ranks_per_node": 4},
      "compute":  {"peak_tflops": 1.0, "utilization": 0.5, "recompute": true},
      "alpha_beta": {"nccl": {"alpha_us": 10, "bandwidth_gbps": 100}}
    }
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ...tuning import MAX_INT, is_number, key_path, read_json, read_text, shown

#: Order of the parallel dimensions in the rank numbering, fastest first (Megatron).
DEFAULT_ORDER = ("tensor", "data", "pipeline")
DISPATCH_MODES = ("uniform", "padded")


class ModelConfigError(ValueError):
    """A model description is malformed; the message names the file and field."""


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts layers (DeepSpeed-MoE / GShard style).

    ``every``: layer i (0-based) is an MoE layer when (i + 1) % every == 0
    (every=2: every other layer, the second of each pair; every=1: all).
    ``capacity_factor``: capacity C = max(ceil(cf * T * top_k / experts),
    min_capacity) tokens per expert from one rank's T tokens; None = no cap.
    ``dispatch``: "uniform" = expected bytes under uniform routing, capped by
    C; "padded" = every expert slot of C tokens is sent (fixed-capacity
    dispatch with padding, as DeepSpeed-MoE/GShard do)."""
    experts: int
    top_k: int = 1
    capacity_factor: Optional[float] = 1.0
    min_capacity: int = 4
    every: int = 2
    ffn_hidden: Optional[int] = None  # expert MLP width (default: the dense ffn_hidden)
    dispatch: str = "uniform"
    count_exchange: bool = False  # an all_to_all of E int64 counts per MoE layer forward (uneven splits)


@dataclass(frozen=True)
class ModelSpec:
    """GPT-style transformer: l layers, hidden h, heads, sequence s, vocabulary V,
    micro-batch b, global batch B_g (sequences), B bytes per element."""
    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab: int
    micro_batch: int
    global_batch: int
    bytes_per_element: int = 2
    grad_bytes_per_element: Optional[int] = None  # default: bytes_per_element
    ffn_hidden: Optional[int] = None  # default 4 * hidden
    position_embeddings: bool = True  # learned positions (s * h parameters)
    tied_embeddings: bool = True  # output layer shares the word embeddings (else + V * h)
    moe: Optional[MoESpec] = None

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def grad_bytes(self) -> int:
        return self.grad_bytes_per_element or self.bytes_per_element

    @property
    def expert_ffn(self) -> int:
        return (self.moe.ffn_hidden or self.ffn) if self.moe else self.ffn

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and (i + 1) % self.moe.every == 0


@dataclass(frozen=True)
class Layout:
    """Parallel layout. ``expert`` (e) splits the experts over e ranks of the
    data dimension; ``zero``: ZeRO stage 0-3 on the data dimension;
    ``dp_bucket_bytes``: gradient bucket size (None: one message, like
    Megatron's contiguous gradient buffer); ``order``: dimension order of the
    rank numbering, fastest first."""
    pipeline: int = 1
    tensor: int = 1
    data: int = 1
    expert: int = 1
    zero: int = 0
    dp_bucket_bytes: Optional[int] = None
    order: tuple = DEFAULT_ORDER

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data


@dataclass(frozen=True)
class Cluster:
    world_size: int
    ranks_per_node: int = 8


@dataclass(frozen=True)
class Compute:
    peak_tflops: Optional[float] = None  # per device
    utilization: float = 0.5  # achieved fraction of the peak for the model's FLOPs
    recompute: bool = True  # full activation recomputation (DESIGN §6 FLOPs)
    dp_overlap: float = 0.0  # fraction of the data-parallel time hidden behind backward


@dataclass(frozen=True)
class AlphaBeta:
    """A declared per-step cost for a backend: alpha (us) per algorithm step,
    bandwidth in GB/s (1e9 bytes/s) per link."""
    alpha_us: float
    bandwidth_gbps: float


@dataclass(frozen=True)
class Config:
    model: ModelSpec
    layout: Layout
    cluster: Cluster
    compute: Compute = field(default_factory=Compute)
    alpha_beta: dict = field(default_factory=dict)  # backend -> AlphaBeta
    name: str = "model"
    source: str = "<config>"

    @property
    def world(self) -> int:
        return self.cluster.world_size

    @property
    def micro_batches(self) -> int:
        """m: micro-batches per iteration per pipeline = B_g / (b * d)."""
        return self.model.global_batch // (self.model.micro_batch * self.layout.data)

    def with_layout(self, pipeline: int, tensor: int, data: int, **kw) -> "Config":
        """The same model and cluster on another (p, t, d) layout, validated."""
        lay = replace(self.layout, pipeline=pipeline, tensor=tensor, data=data, **kw)
        cfg = replace(self, layout=lay, cluster=replace(self.cluster, world_size=lay.world))
        validate(cfg)
        return cfg


# -- loading ----------------------------------------------------------------------------
def load_config(path: str) -> Config:
    """Read and validate a JSON (or, with PyYAML installed, YAML) description."""
    if not path.lower().endswith((".yaml", ".yml")):
        return config_from_dict(read_json(path, "model description", ModelConfigError), source=path)
    text = read_text(path, "model description", ModelConfigError)
    try:
        import yaml
    except ImportError:
        raise ModelConfigError(f"{path}: YAML needs PyYAML, which is not installed "
                               "(pip install pyyaml), or write the description as JSON") from None
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ModelConfigError(f"{path}: malformed YAML: {exc}") from None
    return config_from_dict(doc, source=path)


_TOP = {"name", "model", "parallel", "cluster", "compute", "alpha_beta", "comment"}
_MODEL = {"layers", "hidden", "heads", "seq_length", "vocab", "micro_batch", "global_batch",
          "bytes_per_element", "grad_bytes_per_element", "ffn_hidden", "position_embeddings", "tied_embeddings", "moe"}
_MOE = {"experts", "top_k", "capacity_factor", "min_capacity", "every", "ffn_hidden", "dispatch",
        "count_exchange"}
_PARALLEL = {"pipeline", "tensor", "data", "expert", "zero", "dp_bucket_bytes", "order"}
_CLUSTER = {"world_size", "ranks_per_node"}
_COMPUTE = {"peak_tflops", "utilization", "recompute", "dp_overlap"}
_AB = {"alpha_us", "bandwidth_gbps"}


def config_from_dict(doc: Any, source: str = "<config>") -> Config:
    """Validate a parsed description and build a :class:`Config`."""

    def fail(key: str, msg: str):
        raise ModelConfigError(f"{source}: {key_path(key)}: {msg}")

    def obj(d: Any, key: str, allowed: set, required: bool = True) -> dict:
        if d is None:
            if required:
                fail(key, "required")
            return {}
        if not isinstance(d, dict):
            fail(key, f"expected an object, got {type(d).__name__}")
        extra = sorted(set(d) - allowed, key=str)
        if extra:
            where = f"{key}.{extra[0]}" if key != "(top level)" else extra[0]
            fail(where, f"unknown key (expected one of {', '.join(sorted(allowed))})")
        return d

    def pos_int(d: dict, key: str, where: str, default: Any = ..., minimum: int = 1,
                allow_none: bool = False):
        if key not in d or (d[key] is None and allow_none):
            if default is ...:
                fail(f"{where}.{key}", "required")
            return default
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{where}.{key}", f"expected an integer, got {shown(v)}")
        if not minimum <= v <= MAX_INT:
            fail(f"{where}.{key}", f"must be >= {minimum}, got {shown(v)}" if v < minimum
                 else f"must be <= {MAX_INT}, got {shown(v)}")
        return v

    def number(d: dict, key: str, where: str, default: Any, low: float, high: float = math.inf,
               low_open: bool = True, allow_none: bool = False):
        if key not in d or (d[key] is None and allow_none):
            return default
        v = d[key]
        if not is_number(v):
            fail(f"{where}.{key}", f"expected a finite number, got {shown(v)}")
        if (v <= low if low_open else v < low) or v > high:
            rng = f"{'(' if low_open else '['}{low}, {high}]"
            fail(f"{where}.{key}", f"must be in {rng}, got {v}")
        return float(v)

    def boolean(d: dict, key: str, where: str, default: bool) -> bool:
        if key not in d:
            return default
        if not isinstance(d[key], bool):
            fail(f"{where}.{key}", f"expected true or false, got {shown(d[key])}")
        return d[key]

    top = obj(doc, "(top level)", _TOP)
    name = top.get("name", os.path.splitext(os.path.basename(source))[0] if source != "<config>" else "model")
    if not isinstance(name, str):
        fail("name", f"expected a string, got {shown(name)}")
    if not isinstance(top.get("comment", ""), str):
        fail("comment", f"expected a string, got {shown(top['comment'])}")
    m = obj(top.get("model"), "model", _MODEL)
    moe = None
    if m.get("moe") is not None:
        e = obj(m["moe"], "model.moe", _MOE)
        cf = (None if "capacity_factor" in e and e["capacity_factor"] is None
              else number(e, "capacity_factor", "model.moe", 1.0, 0.0))
        dispatch = e.get("dispatch", "uniform")
        if dispatch not in DISPATCH_MODES:
            fail("model.moe.dispatch", f"expected one of {', '.join(DISPATCH_MODES)}, got {shown(dispatch)}")
        if dispatch == "padded" and cf is None:
            fail("model.moe.dispatch", "padded dispatch needs a capacity_factor")
        moe = MoESpec(experts=pos_int(e, "experts", "model.moe"),
                      top_k=pos_int(e, "top_k", "model.moe", 1),
                      capacity_factor=cf,
                      min_capacity=pos_int(e, "min_capacity", "model.moe", 4, minimum=0),
                      every=pos_int(e, "every", "model.moe", 2),
                      ffn_hidden=pos_int(e, "ffn_hidden", "model.moe", None, allow_none=True),
                      dispatch=dispatch,
                      count_exchange=boolean(e, "count_exchange", "model.moe", False))
    model = ModelSpec(
        layers=pos_int(m, "layers", "model"), hidden=pos_int(m, "hidden", "model"),
        heads=pos_int(m, "heads", "model"), seq_length=pos_int(m, "seq_length", "model"),
        vocab=pos_int(m, "vocab", "model"), micro_batch=pos_int(m, "micro_batch", "model"),
        global_batch=pos_int(m, "global_batch", "model"),
        bytes_per_element=pos_int(m, "bytes_per_element", "model", 2),
        grad_bytes_per_element=pos_int(m, "grad_bytes_per_element", "model", None, allow_none=True),
        ffn_hidden=pos_int(m, "ffn_hidden", "model", None, allow_none=True),
        position_embeddings=boolean(m, "position_embeddings", "model", True),
        tied_embeddings=boolean(m, "tied_embeddings", "model", True), moe=moe)

    par = obj(top.get("parallel", {}), "parallel", _PARALLEL)
    order = par.get("order", list(DEFAULT_ORDER))
    if (not isinstance(order, (list, tuple)) or not all(isinstance(o, str) for o in order)
            or sorted(order) != sorted(DEFAULT_ORDER)):
        fail("parallel.order", f"expected a permutation of {list(DEFAULT_ORDER)}, got {shown(order)}")
    zero = pos_int(par, "zero", "parallel", 0, minimum=0)
    if zero > 3:
        fail("parallel.zero", f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")
    cl = obj(top.get("cluster", {}), "cluster", _CLUSTER)
    world = pos_int(cl, "world_size", "cluster", None, allow_none=True)
    p = pos_int(par, "pipeline", "parallel", 1)
    t = pos_int(par, "tensor", "parallel", 1)
    if "data" in par and par["data"] is not None:
        d = pos_int(par, "data", "parallel")
        if world is None:
            world = p * t * d
        elif p * t * d != world:
            fail("parallel", f"pipeline x tensor x data = {p} x {t} x {d} = {p * t * d} does not "
                             f"equal cluster.world_size {world}")
    else:
        if world is None:
            fail("parallel.data", "required when cluster.world_size is not given")
        if world % (p * t):
            fail("parallel", f"pipeline x tensor = {p} x {t} = {p * t} does not divide "
                             f"cluster.world_size {world} (data = world / (pipeline x tensor))")
        d = world // (p * t)
    layout = Layout(pipeline=p, tensor=t, data=d, expert=pos_int(par, "expert", "parallel", 1),
                    zero=zero,
                    dp_bucket_bytes=pos_int(par, "dp_bucket_bytes", "parallel", None, allow_none=True),
                    order=tuple(order))
    cluster = Cluster(world_size=world, ranks_per_node=pos_int(cl, "ranks_per_node", "cluster", 8))
    c = obj(top.get("compute", {}), "compute", _COMPUTE)
    compute = Compute(peak_tflops=number(c, "peak_tflops", "compute", None, 0.0, allow_none=True),
                      utilization=number(c, "utilization", "compute", 0.5, 0.0, 1.0),
                      recompute=boolean(c, "recompute", "compute", True),
                      dp_overlap=number(c, "dp_overlap", "compute", 0.0, 0.0, 1.0, low_open=False))
    ab_doc = top.get("alpha_beta", {})
    if not isinstance(ab_doc, dict):
        fail("alpha_beta", "expected an object mapping backend names to {alpha_us, bandwidth_gbps}")
    alpha_beta = {}
    for backend, spec in ab_doc.items():
        where = f"alpha_beta.{backend}"
        spec = obj(spec, where, _AB)
        for k in _AB:
            if k not in spec:
                fail(f"{where}.{k}", "required")
        alpha_beta[backend] = AlphaBeta(number(spec, "alpha_us", where, None, 0.0, low_open=False),
                                        number(spec, "bandwidth_gbps", where, None, 0.0))
    cfg = Config(model=model, layout=layout, cluster=cluster, compute=compute,
                 alpha_beta=alpha_beta, name=name, source=source)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks (the per-field ones are done while loading)."""
    src, m, lay = cfg.source, cfg.model, cfg.layout

    def fail(key: str, msg: str):
        raise ModelConfigError(f"{src}: {key}: {msg}")

    p, t, d, e = lay.pipeline, lay.tensor, lay.data, lay.expert
    for key, v in (("pipeline", p), ("tensor", t), ("data", d), ("expert", e)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            fail(f"parallel.{key}", f"must be a positive integer, got {shown(v)}")
    if p * t * d != cfg.cluster.world_size:
        fail("parallel", f"pipeline x tensor x data = {p} x {t} x {d} = {p * t * d} does not "
                         f"equal cluster.world_size {cfg.cluster.world_size}")
    if m.hidden % m.heads:
        fail("model.hidden", f"hidden ({m.hidden}) must be divisible by heads ({m.heads})")
    if m.heads % t:
        fail("parallel.tensor", f"heads ({m.heads}) must be divisible by tensor ({t})")
    if m.ffn % t:
        fail("parallel.tensor", f"ffn_hidden ({m.ffn}) must be divisible by tensor ({t})")
    if m.layers % p:
        fail("parallel.pipeline", f"layers ({m.layers}) must be divisible by pipeline ({p})")
    if m.global_batch % (m.micro_batch * d):
        fail("model.global_batch", f"global_batch ({m.global_batch}) must be divisible by "
                                   f"micro_batch x data = {m.micro_batch} x {d} = {m.micro_batch * d}")
    if lay.zero >= 2 and p > 1:
        fail("parallel.zero", f"ZeRO stage {lay.zero} cannot be combined with pipeline parallelism "
                              f"(pipeline = {p}); use stage 0 or 1")
    if m.moe is None:
        if e != 1:
            fail("parallel.expert", f"expert parallelism ({e}) needs model.moe")
    else:
        if m.moe.top_k > m.moe.experts:
            fail("model.moe.top_k", f"top_k ({m.moe.top_k}) exceeds experts ({m.moe.experts})")
        if m.moe.every > m.layers:
            fail("model.moe.every", f"every ({m.moe.every}) exceeds layers ({m.layers}): no MoE layer")
        if m.moe.experts % e:
            fail("parallel.expert", f"experts ({m.moe.experts}) must be divisible by expert ({e})")
        if d % e:
            fail("parallel.expert", f"expert ({e}) must divide data ({d}): expert-parallel groups "
                                    "are made of data-parallel ranks")
        if m.expert_ffn % t:
            fail("parallel.tensor", f"expert ffn_hidden ({m.expert_ffn}) must be divisible by tensor ({t})")
    if cfg.cluster.ranks_per_node < 1:
        fail("cluster.ranks_per_node", "must be >= 1")
