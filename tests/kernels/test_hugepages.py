"""rtp/kernels/hugepages.py: lazily committed zeros, and whole pages given back to the OS."""

import pytest
import torch

from rtp._libc import madvise
from rtp.kernels import hugepages

needs_madvise = pytest.mark.skipif(madvise is None, reason="no madvise here")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


def test_zeros_are_zero_aligned_and_keep_their_mapping_alive():
    t = hugepages.zeros((3, 5000), torch.float32)
    assert t.shape == (3, 5000) and not t.any() and t.data_ptr() % hugepages.PAGE == 0
    big = hugepages.zeros((5 << 20,), torch.uint8)  # large: starts on a 2 MiB boundary
    assert big.data_ptr() % (2 << 20) == 0
    view = t[1]
    del t
    view.fill_(2.0)  # the view alone keeps the mapping
    assert float(view.sum()) == 10000.0
    assert hugepages.zeros((0, 4), torch.float32).shape == (0, 4)


def test_whole_pages_inside_a_range():
    page = hugepages.PAGE
    assert hugepages.whole_pages(0, 3 * page) == (0, 3 * page)
    assert hugepages.whole_pages(1, 3 * page) == (page, 2 * page)
    assert hugepages.whole_pages(page + 8, page) == (2 * page, 0)


@needs_madvise
def test_released_pages_read_back_as_zeros_and_leave_their_neighbours():
    t = hugepages.zeros((4, 1024), torch.float32)  # 4 rows of one 4 KiB page each
    t.fill_(1.0)
    assert hugepages.release(t[1:3]) == 2 * 4096
    assert t[0].eq(1).all() and not t[1:3].any() and t[3].eq(1).all()
    t[1:3] = 3.0  # written again: committed again
    assert t[1:3].eq(3).all()
    unaligned = t.view(-1)[10:1034 + 1024]  # 8 KiB starting 40 bytes in: one whole page
    assert hugepages.releasable(unaligned) == 4096
    assert hugepages.releasable(torch.zeros(4, 4).t()) == 0  # not contiguous


@needs_madvise
def test_zeros_cost_nothing_until_written_and_release_gives_memory_back():
    before = _rss_mib()
    t = hugepages.zeros((64 << 20,), torch.uint8)
    assert _rss_mib() - before < 16  # mapped, not committed
    t[: 32 << 20].fill_(1)
    written = _rss_mib()
    assert written - before > 24
    hugepages.release(t[: 32 << 20])
    assert written - _rss_mib() > 24
