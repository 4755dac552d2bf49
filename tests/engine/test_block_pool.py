"""The KV block state machine: legal transitions only, fenced reclaim, shared READ_ONLY blocks."""

import pytest

from minisgl_backend.kvcache.block_pool import BlockPool, BlockState, InvariantError


def test_lifecycle_free_writing_readonly_pending_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.state[a] == pool.state[b] == BlockState.WRITING and pool.num_free == 2
    pool.write_completed(a)
    assert pool.state[a] == BlockState.READ_ONLY
    pool.release([a, b], fence=7)  # owner finished while iteration 7 may still read them
    assert pool.state[a] == pool.state[b] == BlockState.PENDING_RECLAIM
    assert pool.retire(6) == 0 and pool.num_free == 2  # an older iteration finishing frees nothing
    assert pool.retire(7) == 2
    assert pool.check_invariants() == {"FREE": 4, "WRITING": 0, "READ_ONLY": 0, "PENDING_RECLAIM": 0}


def test_illegal_transitions_raise():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.write_completed(a)
    with pytest.raises(InvariantError, match="WRITE_COMPLETED in state READ_ONLY"):
        pool.write_completed(a)
    with pytest.raises(InvariantError, match="only 1 free"):
        pool.allocate(2)
    (b,) = pool.allocate(1)
    with pytest.raises(InvariantError, match="share"):
        pool.share(b)  # a block still being written cannot be shared
    pool.release([a, b], fence=0)
    with pytest.raises(InvariantError, match="refcount 0"):
        pool.release([a], fence=0)


def test_shared_readonly_block_waits_for_last_owner():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.write_completed(a)
    pool.share(a)
    pool.release([a], fence=1)
    assert pool.state[a] == BlockState.READ_ONLY and pool.refcount[a] == 1
    pool.release([a], fence=2)
    assert pool.state[a] == BlockState.PENDING_RECLAIM
    pool.retire(2)
    assert pool.state[a] == BlockState.FREE


def test_fences_free_in_order_and_unsafe_mode_frees_at_once():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.release([a], fence=1)
    pool.release([b], fence=3)
    pool.release([c], fence=3)
    assert pool.retire(2) == 1 and pool.retire(3) == 2
    unsafe = BlockPool(1, unsafe_immediate_reclaim=True)
    (x,) = unsafe.allocate(1)
    unsafe.release([x], fence=99)
    assert unsafe.state[x] == BlockState.FREE


def test_check_invariants_detects_corruption():
    pool = BlockPool(3)
    a, _ = pool.allocate(2)
    pool.check_invariants()
    pool.refcount[a] = 0  # an owned block that lost its owner
    with pytest.raises(InvariantError, match="no owner"):
        pool.check_invariants()
    pool = BlockPool(2)
    pool._free.append(0)  # a block listed free twice
    with pytest.raises(InvariantError, match="twice"):
        pool.check_invariants()
