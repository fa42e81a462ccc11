"""torch.compile (inductor, CPU) over the "mcrdl" torch backend at 2 ranks, one job
(tests/jobs/compile_job.py): functional collectives and DTensor compiled with
fullgraph=True equal eager bit for bit; DDP(torch.compile(model)) trains to the same
losses and parameters as on plain gloo.

Inductor's compile time dominates. The job compiles into TORCHINDUCTOR_CACHE_DIR if
set, else into pytest's cache (.pytest_cache/d/torchinductor), so reruns hit
inductor's FX graph cache (about 50 s here against about 75 s cold, on 2 cores)."""
import os
import re
import time

import pytest

from conftest import run_job_rc

#: every check the job files, per part; each must pass on every rank
PARTS = {
    "funcol": ["eager_deterministic", "eager_matches_reference", "eager_via_mcrdl", "explain_no_break",
               "compiled_no_graph_break", "compiled_one_graph", "compiled_by_inductor",
               "compiled_ops_via_mcrdl", "compiled_equal_eager", "compiled_rerun_equal_eager", "ran"],
    "dtensor": ["mesh_on_mcrdl", "redistribute_eager_correct", "redistribute_no_graph_break",
                "redistribute_ops_via_mcrdl", "redistribute_compiled_equal_eager",
                "tp_eager_close_to_unsharded", "tp_no_graph_break", "tp_compiled_by_inductor",
                "tp_ops_via_mcrdl", "tp_compiled_equal_eager", "ran"],
    "ddp": ["optimize_ddp_default_on", "compiled_no_graph_break", "compiled_one_graph",
            "optimizer_split_graph", "compiled_by_inductor", "compiled_grads_via_mcrdl",
            "gloo_run_went_around_mcrdl", "compiled_losses_mcrdl_equal_gloo",
            "compiled_params_mcrdl_equal_gloo", "compiled_close_to_eager", "ran"],
    "c10d_eager": ["same_graph_breaks_as_gloo", "ops_via_mcrdl", "compiled_equal_eager", "ran"],
    "ddp_outer": ["same_graph_breaks_as_gloo", "losses_mcrdl_equal_gloo", "params_mcrdl_equal_gloo", "ran"],
}
RANKS = (0, 1)
TIMES = re.compile(r"TIME (\S+) rank=0 ([\d.]+)s")


@pytest.fixture(scope="module")
def job(request, tmp_path_factory):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        pytest_cache = getattr(request.config, "cache", None)  # (absent with -p no:cacheprovider)
        cache = (pytest_cache.mkdir("torchinductor") if pytest_cache is not None
                 else tmp_path_factory.mktemp("torchinductor"))
    start = time.perf_counter()
    # one compile thread per rank: 2 ranks on 2 cores, and no compile-worker pool to start
    out, _ = run_job_rc(2, "compile_job.py", timeout=300,
                        env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    wall = time.perf_counter() - start
    times = ", ".join(f"{part} {s}s" for part, s in TIMES.findall(out))
    print(f"compile job: {wall:.1f}s wall; rank 0: {times}")
    return out


def check_parts(job, parts, unexpected=False):
    """Each check of ``parts`` passed on every rank; with ``unexpected``, also no
    failed check the table does not name."""
    names = [f"{part}_{check}" for part in parts for check in PARTS[part]]
    tabled = {f"{part}_{check}" for part, checks in PARTS.items() for check in checks}
    job.require(names, RANKS, judged=lambda name: name in names or (unexpected and name not in tabled))


def test_compiled_functional_collectives_dtensor_and_ddp_match_eager_and_gloo(job):
    check_parts(job, ["funcol", "dtensor", "ddp"], unexpected=True)


def test_eager_collectives_between_compiled_graphs_match_gloo(job):
    """torch's eager calls into the "mcrdl" group while dynamo's hook is live (a
    graph break at dist.broadcast; torch.compile(DDP(model))) run outside dynamo
    (torch_backend._run_outside_dynamo): without that, dynamo traces the
    ProcessGroup's methods and fails on the opaque object."""
    check_parts(job, ["c10d_eager", "ddp_outer"])
