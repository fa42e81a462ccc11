"""What users see of a job with torch's tools: mcrdl's ops in torch.profiler
traces, and its flight recorder read by torch's own analyzer (``torchfrtrace``)."""
import pickle
import re
import subprocess
import sys

import pytest

from conftest import run_job_rc


PROFILER_CHECKS = ["one event per op, library and op in its name", "bytes and group size as inputs",
                   "an async op spans until completion", "every event finished"]


@pytest.mark.parametrize("launcher, logged", [("mpiexec", False), ("mpiexec", True), ("torchrun", False)])
def test_every_op_is_a_profiler_event_with_its_library_bytes_and_span(tmp_path, launcher, logged):
    out, rc = run_job_rc(2, "profiler_job.py", tmp_path, *(["logged"] if logged else []), timeout=120,
                         launcher=launcher)
    out.require(PROFILER_CHECKS + ["the logger sees the same ops"] * logged, range(2))
    assert rc == 0, out[-4000:]


def _hang(tmp_path, scenario, launcher="mpiexec"):
    """Run flight_recorder_job.py SCENARIO on 2 ranks with torch's recorder
    variables; returns the job's output and torch's analyzer's report."""
    out, rc = run_job_rc(2, "flight_recorder_job.py", scenario, timeout=120, launcher=launcher,
                         env={"TORCH_FR_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_rank_")})
    report = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                             str(tmp_path), "-p", "fr_rank_", "--allow-incomplete-ranks"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    return out, rc, report.stderr


SKIPPED = (r"Not all ranks joining collective, sequence number: 3\n(.*\n)*collective: gloo:all_reduce mcrdl=mpi\n"
           r"missing ranks: \{1\}")


@pytest.mark.alone  # every rank's dump must arrive within the error's wait, which load can outlast
@pytest.mark.parametrize("scenario, verdict, launcher", [
    ("skip", SKIPPED, "mpiexec"),
    ("skip", SKIPPED, "torchrun"),
    ("op", r"collective: gloo:gather mcrdl=mpi\n(.*\n)*error msg: Culprit rank 1; Error type: "
           r"COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'gather' does not match found "
           r"collective type: 'scatter'", "mpiexec"),
    ("size", r"collective: gloo:all_reduce mcrdl=mpi\n(.*\n)*error msg: Culprit rank 1; Error type: "
             r"SIZE_OR_SYNTAX_MISMATCH, Expected input sizes: '\[\[4, 3\]\]' does not match found input "
             r"sizes: '\[\[64, 1024, 3\]\]'", "mpiexec"),
])
def test_a_hung_job_dumps_every_rank_and_torchs_analyzer_names_rank_and_op(tmp_path, scenario, verdict, launcher):
    out, rc, report = _hang(tmp_path, scenario, launcher)
    assert rc != 0, out[-3000:]
    # A rank whose own op timed out too may be killed by the job's abort while it
    # writes a second dump: its temporary file (named apart, so torch's analyzer
    # skips it) may stay, and the first dump it replaced nothing of stays whole.
    dumps = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".mcrdl-dump-"))
    assert dumps == ["fr_rank_0", "fr_rank_1"], out[-3000:]
    assert re.search(r"rank \d: flight recorder dumped to .* \(\w+ on backend 'mpi' timed out\)", out), out[-3000:]
    named = [v for v in out.verdicts if v["name"] == "the error names every rank's dumps"]
    assert named and all(v["ok"] for v in named), (named, out[-3000:])  # in the error itself
    assert re.search(verdict, report), report
    # the stack points at the job's line, not into mcrdl
    assert re.search(r"collective stack trace: \n <module> at .*flight_recorder_job\.py:\d+", report), report


def test_the_recorder_dumps_on_sigusr1_and_on_request_and_a_healthy_job_reads_clean(tmp_path):
    out, rc, report = _hang(tmp_path, "signal")
    assert rc == 0, out[-3000:]
    assert out.count("(SIGUSR1)") == 2 and "(requested)" in out, out[-3000:]
    assert report.strip().splitlines()[-1:] in ([], ["tabulate is not installed. Proceeding without it."]), report
    with open(tmp_path / "fr_rank_1", "rb") as f:
        dump = pickle.load(f)
    entries = dump["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce mcrdl=mpi"] * 2, entries
    assert all(e["state"] == "completed" and e["library"] == "mpi" for e in entries), entries
    assert dump["pg_config"] == {"world": {"name": "world", "desc": "default_pg", "ranks": "[0, 1]"}}


def test_a_dead_peer_makes_the_survivor_dump(tmp_path):
    """Under torchrun: MPICH's mpiexec would end the survivor at once."""
    out, rc, report = _hang(tmp_path, "killed", "torchrun")
    assert rc != 0
    assert "rank 0: flight recorder dumped to" in out and "(rank 1 died (its process ended))" in out, out[-3000:]
    assert "missed FR dumps from ranks ({1})" in report, report
