"""Without a CUDA device the client says why its arena mapping is not page-locked."""

import torch


def test_no_cuda_means_pageable_with_a_reason(daemon):
    from tierstore.client.cuda import register_host_memory

    if torch.cuda.is_available():
        return  # covered by tests/test_gpu.py
    pieces, why = register_host_memory(1 << 20, 1 << 20)
    assert pieces == [] and "no CUDA device" in why
    with daemon.client("cpu") as c:
        assert c.pinned is False and c.pinned_reason
