"""What users see of a job with torch's tools: mcrdl's ops in torch.profiler
traces, and its flight recorder read by torch's own analyzer."""
import re

import pytest

from conftest import run_job_rc


def verdicts(out: str, nprocs: int, expected: int) -> None:
    """Every ``CHECK`` line passed, ``expected`` checks on each of ``nprocs`` ranks."""
    lines = re.findall(r"^CHECK (.*) rank=(\d+) (ok|FAIL.*)$", out, re.M)
    failed = [f"rank {r}: {name}: {verdict}" for name, r, verdict in lines if verdict != "ok"]
    assert not failed, "\n".join(failed)
    per_rank = {r: sum(1 for _, rr, _ in lines if rr == str(r)) for r in range(nprocs)}
    assert per_rank == {r: expected for r in range(nprocs)}, out[-4000:]


@pytest.mark.parametrize("logged", [False, True])
def test_every_op_is_a_profiler_event_with_its_library_bytes_and_span(tmp_path, logged):
    out, rc = run_job_rc(2, "profiler_job.py", tmp_path, *(["logged"] if logged else []), timeout=120)
    verdicts(out, 2, 5 if logged else 4)
    assert rc == 0, out[-4000:]
