"""The host flag: a stream waits on the device until a host thread writes the step's number (the
grammar masks' copy behind the pipeline's job); its kernel under Triton's interpreter on the CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagoda.structured_output import host_flag


def test_the_wait_kernel_returns_once_the_counter_is_reached() -> None:
    if host_flag.triton is None or torch.cuda.is_available():
        pytest.skip("the interpreter case: triton without CUDA")
    counter = torch.tensor([3], dtype=torch.int64)
    host_flag._wait_kernel[(1,)](counter, 3)  # the interpreter runs it now: it must not spin


@pytest.mark.gpu
def test_a_stream_waits_for_the_host_thread() -> None:
    flag = host_flag.HostFlag()
    stream = torch.cuda.Stream()
    assert flag.wait_on_device(1, stream)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(0.2)
    assert not done.query()  # still polling: nothing wrote 1 yet
    threading.Thread(target=flag.set, args=(1,)).start()
    done.synchronize()
    assert flag.usable
