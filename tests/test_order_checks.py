"""Program order (DESIGN hazard 3) at the engine: a new op waits for exactly
the outstanding works that write memory it touches or touch memory it writes,
however many are in flight, whatever their layout. In-process; the real
cross-backend jobs are in test_hazards.py."""
import torch

from mcrdl.work import Engine, Pending


class Held(Pending):
    """Completes only when waited for, and remembers that it was."""

    __slots__ = ("waited",)

    def __init__(self):
        self.waited = False

    def test(self) -> bool:
        return self.waited

    def block(self, deadline: float) -> bool:
        self.waited = True
        return True


def start(engine, reads=(), writes=()):
    pending = Held()
    engine.run("op", "test", pending, tuple(reads), tuple(writes), (), None, (), True)
    return pending


def waited(pendings):
    return [i for i, p in enumerate(pendings) if p.waited]


def test_only_the_conflicting_work_of_many_in_flight_is_waited_for():
    engine, buf = Engine(), torch.zeros(1000)
    others = [torch.zeros(50) for _ in range(8)]  # elsewhere in memory, between the slices' works
    slices = [start(engine, writes=[buf[i * 50:(i + 1) * 50]]) for i in range(20)]
    apart = [start(engine, writes=[t]) for t in others]
    engine.order_before((buf[420:430],), (), "reader")
    assert waited(slices) == [8] and waited(apart) == []
    engine.order_before((), (buf[0:1], buf[999:1000]), "writer of both ends")  # bounds span every slice
    assert waited(slices) == [0, 8, 19] and waited(apart) == []


def test_reads_do_not_wait_for_reads_and_empty_tensors_conflict_with_nothing():
    engine, buf = Engine(), torch.zeros(100)
    readers = [start(engine, reads=[buf]) for _ in range(4)]
    engine.order_before((buf,), (), "another reader")
    engine.order_before((), (buf[5:5], torch.zeros(0)), "empty writes")
    assert waited(readers) == []
    engine.order_before((), (buf[99:],), "a writer of the last element")
    assert waited(readers) == [0, 1, 2, 3]


def test_strided_views_conflict_by_the_memory_they_span():
    engine, buf = Engine(), torch.zeros(100, 10)
    column = start(engine, writes=[buf[:, 3]])  # non-contiguous: spans rows 0-99
    row = start(engine, writes=[buf[50:51, 5:7]])
    engine.order_before((buf[99, 9:],), (), "reader past the column's last element")
    assert waited([column, row]) == []
    engine.order_before((buf[60, :2],), (), "reader inside the column's span")
    assert waited([column, row]) == [0]


def test_an_in_place_op_is_one_written_range():
    engine, buf = Engine(), torch.zeros(64)
    start(engine, reads=[buf], writes=[buf])
    work = engine.outstanding[0]
    engine.order_before((torch.zeros(1),), (), "unrelated")  # computes the work's ranges
    low, high, ranges = work._spans
    assert [(r[1], r[2], r[3]) for r in ranges] == [(buf.data_ptr(), buf.data_ptr() + 256, True)]
    assert (low, high) == (buf.data_ptr(), buf.data_ptr() + 256)


def test_a_work_keeps_the_ranges_its_own_check_computed():
    engine, buf, other = Engine(), torch.zeros(8), torch.zeros(8)
    start(engine, writes=[other])
    reads = writes = (buf,)
    checked = engine.order_before(reads, writes, "op")
    engine.run("op", "test", Held(), reads, writes, (), None, (), True, checked)
    assert engine.outstanding[-1]._spans is checked
    assert checked[0] == buf.data_ptr() and len(checked[2]) == 1
