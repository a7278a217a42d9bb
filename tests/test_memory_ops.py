"""Cache edits on the shared context: queued while a call holds its lock, applied in order before the next use."""
import threading
import time

from specdecode.backends.memory_ops import Locked, MemoryOps


class FakeLc:
    """llama_cpp's memory calls, recording the order they ran in."""

    def __init__(self):
        self.log = []

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        self.log.append(("rm", seq))
        return True

    def llama_memory_seq_cp(self, mem, src, dst, p0, p1):
        self.log.append(("cp", src, dst))

    def llama_memory_seq_pos_max(self, mem, seq):
        self.log.append(("pos_max", seq))
        return 7

    def llama_n_ctx(self, ctx):
        return 4096


def edit_while_held(ops: MemoryOps, lc: FakeLc, hold_s: float = 0.5) -> float:
    """Seconds an edit took while another thread held the context's lock for hold_s (a running call)."""
    held = threading.Event()

    def call():
        with ops.lock:
            held.set()
            time.sleep(hold_s)
    t = threading.Thread(target=call)
    t.start()
    held.wait()
    start = time.perf_counter()
    Locked(lc, ops).llama_memory_seq_rm(None, 3, -1, -1)
    took = time.perf_counter() - start
    t.join()
    return took


def test_an_edit_during_a_call_does_not_wait_and_is_applied_before_the_next_call():
    lc = FakeLc()
    ops = MemoryOps(threading.Lock())
    assert edit_while_held(ops, lc) < 0.1  # queued, not waiting for the call
    assert lc.log == [] and ops.applied_later == 1
    Locked(lc, ops).llama_memory_seq_cp(None, 0, 3, 0, 10)  # the next use applies the queued edit first
    assert lc.log == [("rm", 3), ("cp", 0, 3)]


def test_negative_control_without_queueing_an_edit_waits_for_the_call():
    lc = FakeLc()
    assert edit_while_held(MemoryOps(threading.Lock(), queue_edits=False), lc) > 0.4
    assert lc.log == [("rm", 3)]


def test_a_read_waits_and_sees_every_queued_edit_first():
    lc = FakeLc()
    ops = MemoryOps(threading.Lock())
    locked = Locked(lc, ops)
    with ops.lock:  # a call is running: two edits queue
        assert locked.llama_memory_seq_rm(None, 1, -1, -1) is True
        locked.llama_memory_seq_cp(None, 2, 1, 0, 5)
    assert locked.llama_memory_seq_pos_max(None, 1) == 7  # not an edit: runs under the lock, after the queue
    assert lc.log == [("rm", 1), ("cp", 2, 1), ("pos_max", 1)]
    assert locked.llama_n_ctx(None) == 4096  # not a memory call: the binding itself


def test_the_decode_applies_queued_edits_before_its_call():
    lc = FakeLc()
    ops = MemoryOps(threading.Lock())
    with ops.lock:
        Locked(lc, ops).llama_memory_seq_rm(None, 5, 3, -1)
    with ops.lock:  # as SharedContext._decode does
        ops.apply_queued()
        lc.log.append(("decode",))
    assert lc.log == [("rm", 5), ("decode",)]
